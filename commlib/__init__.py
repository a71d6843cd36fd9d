"""commlib: collectives for distributed training, as schedules over MPI and C++ kernels.

    import commlib
    comm = commlib.init()
    comm.all_reduce(t)
"""
from . import _C
from .call import ReduceOp
from .algorithms import algorithms
from .comm import (Communicator, all_gather, all_reduce, all_to_all, barrier, broadcast, finalize,
                   init, recv, reduce, reduce_scatter, send)
from .errors import CollectiveMismatchError, CommError, CommTimeoutError
from .work import Work, wait_all

__all__ = ["CollectiveMismatchError", "Communicator", "CommError", "CommTimeoutError",
           "ReduceOp", "Work", "algorithms", "all_gather", "all_reduce", "all_to_all", "barrier",
           "broadcast", "build_info", "finalize", "init", "recv", "reduce", "reduce_scatter",
           "send", "wait_all"]


def build_info() -> dict:
    """What the C++ extension was compiled with, and what the GPU path has (cuda.build_info)."""
    from . import cuda
    return {**_C.build_info(), **cuda.build_info()}
