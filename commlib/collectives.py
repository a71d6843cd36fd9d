"""The collectives as module functions: each is its communicator's method, ``comm=None``
meaning the world (commlib.init())."""
from __future__ import annotations


def _comm(comm):
    from .comm import Communicator, init
    if comm is None:
        return init()
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a commlib.Communicator (or None for the world), got "
                        f"{type(comm).__name__}")
    return comm


def all_reduce(t, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    """Reduce ``t`` over all ranks, in place; returns ``t`` (a Work if ``async_op``)."""
    return _comm(comm).all_reduce(t, op, algorithm, async_op, timeout)


def reduce_scatter(output, input, op="sum", algorithm=None, comm=None, async_op=False,
                   timeout=None):
    """Reduce ``input`` (size * output.numel elements) over all ranks; rank r keeps block r."""
    return _comm(comm).reduce_scatter(output, input, op, algorithm, async_op, timeout)


def all_gather(output, input, algorithm=None, comm=None, async_op=False, timeout=None):
    """Concatenate every rank's ``input`` into ``output`` (size * input.numel elements)."""
    return _comm(comm).all_gather(output, input, algorithm, async_op, timeout)


def all_to_all(output, input, output_splits=None, input_splits=None, algorithm=None, comm=None,
               async_op=False, timeout=None):
    """Rank r sends input's j-th part to rank j, receiving rank j's r-th part into output."""
    return _comm(comm).all_to_all(output, input, output_splits, input_splits, algorithm,
                                  async_op, timeout)


def broadcast(t, root=0, algorithm=None, comm=None, async_op=False, timeout=None):
    """Copy ``t`` from ``root`` to every rank, in place; returns ``t``."""
    return _comm(comm).broadcast(t, root, algorithm, async_op, timeout)


def reduce(t, root=0, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    """Reduce ``t`` over all ranks into ``t`` on ``root``; other ranks' ``t`` is unchanged."""
    return _comm(comm).reduce(t, root, op, algorithm, async_op, timeout)


def barrier(comm=None, async_op=False, timeout=None):
    """Return once every rank has called barrier (a Work if ``async_op``)."""
    return _comm(comm).barrier(async_op, timeout)


def send(t, dst, tag=0, comm=None, async_op=False, timeout=None):
    """Send ``t`` to rank ``dst`` (see Communicator.send)."""
    return _comm(comm).send(t, dst, tag, async_op, timeout)


def recv(t, src, tag=0, comm=None, async_op=False, timeout=None):
    """Receive into ``t`` from rank ``src`` (see Communicator.recv)."""
    return _comm(comm).recv(t, src, tag, async_op, timeout)
