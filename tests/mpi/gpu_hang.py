"""A call through CUDA IPC that rank 1 never makes, on the simulated GPU, with a timeout
longer than the case's limit (COMMLIB_TEST_CASE_SECONDS): rank 0's case outlives its limit
and reports where it stands (stacks.py), as .ci/gpu's cases do on a lent GPU."""
import os
import time

import numpy as np

import commlib
from commlib import cuda
import stacks
from harness import Checker
from tests.simulated_gpu import HostArray

comm = commlib.init()


def a_call_rank_1_never_makes():
    t = HostArray(np.ones(1000, np.float32))
    comm.all_reduce(t)  # (sets up IPC, collectively)
    cuda.streams().stream_synchronize(0, 0)
    if comm.rank == 0:
        comm.all_reduce(t, timeout=60)
        cuda.streams().stream_synchronize(0, 0)  # waits for the proxy, which waits for rank 1
    else:  # (outlives rank 0's limit: rank 0 reports inside its case, not once the
        # call failed for rank 1's exit, as it did when rank 1 armed first on a loaded host)
        stacks.arm(2 * float(os.environ["COMMLIB_TEST_CASE_SECONDS"]), "rank 1's sleep")
        time.sleep(60)


Checker().run_cases(globals())
