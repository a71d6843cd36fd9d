"""direct: host-only collectives that read the peers' published data in place
(csrc/shm_direct.cpp). Every rank copies its input into shared memory once and reads what
it needs straight from the others: no chain of n-1 steps, one barrier or two per piece.
"""
from itertools import accumulate

from .. import _C
from . import register


def all_reduce(comm, bufs, dtype, op):
    b = bufs["out"]
    comm._executor.transport.all_reduce(b.ptr, b.numel, dtype.code, _C.OPS[op], 3)


def reduce(comm, bufs, dtype, op, root=0):
    b = bufs["out"]
    comm._executor.transport.reduce(b.ptr, b.numel, dtype.code, _C.OPS[op], root)


def reduce_scatter(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    comm._executor.transport.reduce_scatter(out.ptr, inp.ptr, out.numel, dtype.code, _C.OPS[op])


def all_gather(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    comm._executor.transport.all_gather(out.ptr, inp.ptr, inp.numel, dtype.code)


def broadcast(comm, bufs, dtype, op, root=0):
    b = bufs["out"]
    comm._executor.transport.broadcast(b.ptr, b.numel, dtype.code, root)


def all_to_all(comm, bufs, dtype, op, input_splits, output_splits):
    size = dtype.itemsize
    offsets = lambda splits: [0, *accumulate(s * size for s in splits[:-1])]  # noqa: E731
    comm._executor.transport.all_to_all(
        bufs["out"].ptr, bufs["in"].ptr, dtype.code, offsets(input_splits),
        [s * size for s in input_splits], offsets(output_splits),
        [s * size for s in output_splits])


for _fn in (all_reduce, reduce, reduce_scatter, all_gather, broadcast, all_to_all):
    register("direct", _fn.__name__, run=_fn, requires="shm")
