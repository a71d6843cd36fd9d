"""Rank 1 raises while the others wait for it in a collective: the whole job must end at
once, non-zero, with rank 1's traceback (commlib/abort.py), not hang in MPI_Finalize."""
import numpy as np

import commlib

comm = commlib.init()
if comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
comm.all_reduce(np.ones(1000))
print(f"rank {comm.rank} RETURNED from a collective its peer never joined", flush=True)
