"""native: the MPI library's own collectives through mpi4py (the baseline to beat).

MPI has no bfloat16 and no portable float16 reductions, so 16-bit floats reduce through a
user-defined MPI op that calls commlib's own kernels. Each runs as MPI's non-blocking
collective, waited for with the communicator's timeout (a blocking one cannot time out).
"""
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from .. import _C
from ..work import Deadline, wait_request
from . import register

_MPI_TYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T,
              "uint8": MPI.UINT8_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
              "float16": MPI.UINT16_T, "bfloat16": MPI.UINT16_T}
_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
            "avg": MPI.SUM}  # the caller scales


@lru_cache(maxsize=None)
def _kernel_op(dtype_code: int, op_code: int) -> MPI.Op:
    def apply(inbuf, inoutbuf, datatype):
        src, dst = np.frombuffer(inbuf, np.uint8), np.frombuffer(inoutbuf, np.uint8)
        _C.reduce_into(dst.ctypes.data, src.ctypes.data, dst.size // 2, dtype_code, op_code)
    return MPI.Op.Create(apply, commute=True)


def _spec(buf):
    return [buf.bytes, _MPI_TYPES[buf.dtype.name]]


def _op(dtype, op):
    if dtype.itemsize == 2 and dtype.floating:
        return _kernel_op(dtype.code, _C.OPS[op])
    return _MPI_OPS[op]


def _count(comm, nbytes: float) -> None:
    """MPI's traffic is hidden: count the least any algorithm sends (Communicator.bytes_sent)."""
    comm._native_bytes_sent += int(nbytes)


def _wait(comm, request, keep) -> None:
    wait_request(request, Deadline(comm._executor.timeout), "its peers inside MPI's "
                 "collective (MPI does not say which)", keep=keep)


def all_reduce(comm, bufs, dtype, op):
    _count(comm, 2 * (comm.size - 1) / comm.size * bufs["out"].nbytes)
    _wait(comm, comm._coll.Iallreduce(MPI.IN_PLACE, _spec(bufs["out"]), _op(dtype, op)), bufs)


def reduce_scatter(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    _count(comm, (comm.size - 1) * out.nbytes)
    if out.overlaps(inp):  # MPI's in-place form leaves the result at the front, not in block r
        result = np.empty_like(out.bytes)
        _wait(comm, comm._coll.Ireduce_scatter_block(_spec(inp), [result, _MPI_TYPES[dtype.name]],
                                                     _op(dtype, op)), (bufs, result))
        out.bytes[:] = result
    else:
        _wait(comm, comm._coll.Ireduce_scatter_block(_spec(inp), _spec(out), _op(dtype, op)), bufs)


def all_gather(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    _count(comm, (comm.size - 1) * inp.nbytes)
    send = MPI.IN_PLACE if out.overlaps(inp) else _spec(inp)
    _wait(comm, comm._coll.Iallgather(send, _spec(out)), bufs)


def all_to_all(comm, bufs, dtype, op, input_splits, output_splits):
    mpi_type = _MPI_TYPES[dtype.name]
    _count(comm, (sum(input_splits) - input_splits[comm.rank]) * dtype.itemsize)
    displs = lambda splits: np.concatenate([[0], np.cumsum(splits)[:-1]])  # noqa: E731
    _wait(comm, comm._coll.Ialltoallv(
        [bufs["in"].bytes, (input_splits, displs(input_splits)), mpi_type],
        [bufs["out"].bytes, (output_splits, displs(output_splits)), mpi_type]), bufs)


def broadcast(comm, bufs, dtype, op, root=0):
    _count(comm, bufs["out"].nbytes if comm.size > 1 else 0)
    _wait(comm, comm._coll.Ibcast(_spec(bufs["out"]), root), bufs)


def reduce(comm, bufs, dtype, op, root=0):
    _count(comm, bufs["out"].nbytes if comm.size > 1 else 0)
    if comm.rank == root:
        request = comm._coll.Ireduce(MPI.IN_PLACE, _spec(bufs["out"]), _op(dtype, op), root)
    else:
        request = comm._coll.Ireduce(_spec(bufs["out"]), None, _op(dtype, op), root)
    _wait(comm, request, bufs)


for _fn in (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, reduce):
    register("native", _fn.__name__, run=_fn, requires="mpi")
