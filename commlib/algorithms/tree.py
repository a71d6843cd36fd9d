"""Binomial trees: ceil(log2 n) rounds, the latency-optimal choice for small messages.

Ranks are renumbered relative to the root (v = (rank - root) mod n); v's parent is v with
its lowest set bit cleared, its children are v + 2^k for 2^k below that bit.
"""
from ..schedule import Builder, Recv, RecvReduce, Region, Send
from .registry import log2_rounds as _log, schedule


def _reduce_into(b, size, rank, count, root, in_place):
    """Children's partials are folded in one per round, then sent to the parent.

    Without ``in_place`` a non-root rank keeps its own buffer intact and accumulates in tmp.
    """
    v = (rank - root) % size
    real = lambda u: (u + root) % size  # noqa: E731
    data = Region("out", 0, count)
    acc = data if (in_place or v == 0) else Region("tmp", 0, count)
    partial = data
    mask = 1
    while mask < size:
        if v & mask:
            b.round(Send(real(v - mask), partial))
            break
        if v + mask < size:
            b.round(RecvReduce(real(v + mask), acc, partial))
            partial = acc
        mask <<= 1
    return partial is not data and acc is not data


def _broadcast_into(b, size, rank, count, root):
    v = (rank - root) % size
    real = lambda u: (u + root) % size  # noqa: E731
    data = Region("out", 0, count)
    mask = 1
    while mask < size:
        if v & mask:
            b.round(Recv(real(v - mask), data))
            break
        mask <<= 1
    b.round(*[Send(real(v + m), data) for m in _powers_below(mask) if v + m < size])


def _powers_below(mask):
    m = mask >> 1
    while m:
        yield m  # biggest subtree first: it has the longest way to go
        m >>= 1


@schedule("tree", "reduce", lambda n, N: (_log(n), _log(n) * N, _log(n) * N))
def reduce(size, rank, count, itemsize, root=0):
    b = Builder()
    used_tmp = _reduce_into(b, size, rank, count, root, in_place=False)
    return b.build(tmp_count=count if used_tmp else 0)


@schedule("tree", "broadcast", lambda n, N: (_log(n), _log(n) * N, 0))
def broadcast(size, rank, count, itemsize, root=0):
    b = Builder()
    _broadcast_into(b, size, rank, count, root)
    return b.build()


@schedule("tree", "all_reduce", lambda n, N: (2 * _log(n), 2 * _log(n) * N, _log(n) * N))
def all_reduce(size, rank, count, itemsize):
    b = Builder()
    _reduce_into(b, size, rank, count, 0, in_place=True)
    _broadcast_into(b, size, rank, count, 0)
    return b.build()
