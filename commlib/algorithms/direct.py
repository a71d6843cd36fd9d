"""direct: host-only collectives that read the peers' published data in place
(csrc/shm_direct.cpp). Every rank copies its input into shared memory once and reads what
it needs straight from the others: no chain of n-1 steps, one barrier or two per piece.
"""
from .. import _C
from . import register


def _call(comm, method, *args):
    executor = comm._executor
    executor.call(getattr(executor.transport, method), *args)


def all_reduce(comm, bufs, dtype, op):
    b = bufs["out"]
    _call(comm, "all_reduce", b.ptr, b.numel, dtype.code, _C.OPS[op], 3)


def reduce(comm, bufs, dtype, op, root=0):
    b = bufs["out"]
    _call(comm, "reduce", b.ptr, b.numel, dtype.code, _C.OPS[op], root)


def reduce_scatter(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    _call(comm, "reduce_scatter", out.ptr, inp.ptr, out.numel, dtype.code, _C.OPS[op])


def all_gather(comm, bufs, dtype, op):
    out, inp = bufs["out"], bufs["in"]
    _call(comm, "all_gather", out.ptr, inp.ptr, inp.nbytes)


def broadcast(comm, bufs, dtype, op, root=0):
    b = bufs["out"]
    _call(comm, "broadcast", b.ptr, b.nbytes, root)


for _fn in (all_reduce, reduce, reduce_scatter, all_gather, broadcast):
    register("direct", _fn.__name__, run=_fn, requires="shm")
