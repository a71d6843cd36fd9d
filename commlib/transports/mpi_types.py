"""MPI's names for commlib's dtypes and reduce ops: what MPI's own collectives take
(algorithms/native.py) and what the C++ fast path is told (c_tables). MPI has no bfloat16
and no portable float16 reductions, so 16-bit floats (and commlib's user-defined ops)
reduce through an MPI op (MPI.Op.Create) that calls commlib's own kernels.
"""
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from .. import _C
from ..dtypes import BY_CODE

_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
            "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR,
            "avg": MPI.SUM}  # the caller scales


@lru_cache(maxsize=None)
def _kernel_op(dtype_code: int, op_code: int) -> MPI.Op:
    itemsize = BY_CODE[dtype_code].itemsize

    def apply(inbuf, inoutbuf, datatype):
        src, dst = np.frombuffer(inbuf, np.uint8), np.frombuffer(inoutbuf, np.uint8)
        _C.reduce_into(dst.ctypes.data, src.ctypes.data, dst.size // itemsize, dtype_code,
                       op_code)
    return MPI.Op.Create(apply, commute=True)


def c_tables() -> tuple[dict, dict, list]:
    """What csrc/mpi_native.cpp needs to make MPI's collectives itself (the fast path's): MPI's
    datatype per dtype code and op per op code, as handles, and the dtypes MPI reduces
    itself (not 16-bit floats)."""
    dtypes = {d.code: MPI._handleof(getattr(MPI, d.mpi)) for d in BY_CODE
              if getattr(MPI, d.mpi, MPI.DATATYPE_NULL) != MPI.DATATYPE_NULL}
    ops = {_C.OPS[name]: MPI._handleof(op) for name, op in _MPI_OPS.items()}
    return dtypes, ops, [d.code for d in BY_CODE if not (d.itemsize == 2 and d.floating)]


def spec(buf):
    """The buffer as mpi4py takes it: its bytes and MPI's datatype."""
    return [buf.bytes, getattr(MPI, buf.dtype.mpi)]


def op_for(call) -> MPI.Op:
    """MPI's op for ``call``: its own, else one that runs commlib's kernels."""
    if not call.op.builtin or (call.dtype.itemsize == 2 and call.dtype.floating):
        return _kernel_op(call.dtype.code, call.op_code)
    return _MPI_OPS[call.op.value]
