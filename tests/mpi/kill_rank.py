"""The last rank is SIGKILLed while its peers wait for it in a collective: each survivor
must raise (at once on shared memory, which sees the process gone; within the timeout
over MPI), and the job must end non-zero leaving nothing behind. Launched with
mpiexec -disable-auto-cleanup so that the survivors live long enough to be seen raising
(by default mpiexec kills them as soon as one rank dies).

Usage: mpiexec -disable-auto-cleanup -n N python tests/mpi/kill_rank.py   (N >= 2)
"""
import os
import signal
import time

import numpy as np

import commlib

world = commlib.init()
comm = world.dup()
for _ in range(3):
    comm.all_reduce(np.ones(1000))
if world.rank == world.size - 1:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    comm.all_reduce(np.ones(100_000))
except commlib.CommError as e:
    print(f"SURVIVOR rank {world.rank} raised after {time.monotonic() - start:.3f} s: "
          f"{type(e).__name__}: {e}", flush=True)
    time.sleep(float(os.environ.get("GRACE", 1)))  # let every survivor report before the first one's abort ends the job
    raise
print(f"rank {world.rank} RETURNED from a collective with a dead peer", flush=True)
