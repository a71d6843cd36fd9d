"""The last rank is SIGKILLed while its peers wait for it in a collective: each survivor
must raise (at once on shared memory, which sees the process gone; within the timeout
over MPI), and the job must end non-zero leaving nothing behind. Each survivor
reports to a file in $REPORT_DIR as well as to stdout: mpiexec kills the survivors soon
after the death (even with -disable-auto-cleanup), and what they printed can be lost with
them; the file is written the moment they raise.

With "async", the last rank dies while an async all_reduce of 64 MiB is on the wire and
its peers compute beside it (at 1 Gbit/s it takes half a second): their wait must raise.

Usage: mpiexec -disable-auto-cleanup -n N python tests/mpi/kill_rank.py [async]   (N >= 2)
"""
import os
import signal
import sys
import time

import numpy as np

import commlib

world = commlib.init()
comm = world.dup()
for _ in range(3):
    comm.all_reduce(np.ones(1000))
overlapped = sys.argv[1:] == ["async"]
if world.rank == world.size - 1 and not overlapped:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    if overlapped:
        work = comm.all_reduce(np.ones(8 << 20), async_op=True)  # (64 MiB)
        if world.rank == world.size - 1:
            time.sleep(0.05)  # (its bytes on the wire)
            os.kill(os.getpid(), signal.SIGKILL)
        a = np.full((256, 256), 0.5)
        while time.monotonic() - start < 0.3:  # computing beside it
            a @ a
        work.wait()
    else:
        comm.all_reduce(np.ones(100_000))
except commlib.CommError as e:
    report = (f"SURVIVOR rank {world.rank} raised after {time.monotonic() - start:.3f} s: "
              f"{type(e).__name__}: {e}")
    with open(os.path.join(os.environ.get("REPORT_DIR", "."), f"rank-{world.rank}.txt"),
              "w") as f:
        f.write(report + "\n")
    print(report, flush=True)
    time.sleep(1)  # let every survivor report before the first one's abort ends the job
    raise
print(f"rank {world.rank} RETURNED from a collective with a dead peer", flush=True)
