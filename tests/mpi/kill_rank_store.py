"""kill_rank.py without mpiexec: ranks meet through a torch FileStore (Communicator.from_store),
so no launcher kills the survivors when the last rank dies, and each must see the death
itself and raise, naming the dead rank, within a second.

Usage: python tests/mpi/kill_rank_store.py RANK SIZE STORE_FILE REPORT_DIR   (one per rank)
"""
import os
import signal
import sys
import time

import numpy as np
import torch.distributed as dist

import commlib

rank, size, store_file, report_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
# each rank is an MPI singleton here, with an MPICH segment of its own that the killed one
# would leave behind: unlinked now, as commlib.init() does for a world
commlib.abort.unlink_mpich_segments()
comm = commlib.Communicator.from_store(dist.FileStore(store_file, size), rank, size)
comm.timeout = 10
try:
    for i in range(4):
        if i == 3 and rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        # a peer may still be finishing call 3 (reading what the dead rank published) when
        # the death is seen: that call raises then, as it should
        start = time.monotonic()
        comm.all_reduce(np.ones(100_000 if i == 3 else 1000))
    outcome = "RETURNED from a collective with a dead peer"
except commlib.CommError as e:
    outcome = f"raised after {time.monotonic() - start:.3f} s: {type(e).__name__}: {e}"
with open(os.path.join(report_dir, f"rank-{rank}.txt"), "w") as f:
    f.write(f"SURVIVOR rank {rank} {outcome}\n")
