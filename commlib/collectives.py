"""The collectives as module functions: each is its communicator's method (whose docstring
it shows), ``comm=None`` meaning the world (commlib.init())."""
from __future__ import annotations

from .comm import Communicator, init


def _comm(comm):
    if comm is None:
        return init()
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a commlib.Communicator (or None for the world), got "
                        f"{type(comm).__name__}")
    return comm


def all_reduce(t, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).all_reduce(t, op, algorithm, async_op, timeout)


def reduce_scatter(output, input, op="sum", algorithm=None, comm=None, async_op=False,
                   timeout=None):
    return _comm(comm).reduce_scatter(output, input, op, algorithm, async_op, timeout)


def all_gather(output, input, algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).all_gather(output, input, algorithm, async_op, timeout)


def all_to_all(output, input, output_splits=None, input_splits=None, algorithm=None, comm=None,
               async_op=False, timeout=None):
    return _comm(comm).all_to_all(output, input, output_splits, input_splits, algorithm,
                                  async_op, timeout)


def broadcast(t, root=0, algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).broadcast(t, root, algorithm, async_op, timeout)


def reduce(t, root=0, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).reduce(t, root, op, algorithm, async_op, timeout)


def barrier(comm=None, async_op=False, timeout=None):
    return _comm(comm).barrier(async_op, timeout)


def send(t, dst, tag=0, comm=None, async_op=False, timeout=None):
    return _comm(comm).send(t, dst, tag, async_op, timeout)


def recv(t, src, tag=0, comm=None, async_op=False, timeout=None):
    return _comm(comm).recv(t, src, tag, async_op, timeout)


for _fn in (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, reduce, barrier,
            send, recv):
    _fn.__doc__ = getattr(Communicator, _fn.__name__).__doc__
