"""Ring algorithms: bandwidth-optimal, n-1 steps per phase, each rank talks to two neighbours.

A *block* is the 1/n share of the data that one rank finally owns; blocks of all_reduce
differ in size by at most one element, so counts below the world size just leave some empty.
"""
from ..schedule import Builder, Copy, Recv, RecvReduce, Region, Send, chunks
from .registry import schedule

# Broadcast pipelines segments of about this many bytes along the chain.
BROADCAST_SEGMENT_BYTES = 256 * 1024
BROADCAST_MAX_SEGMENTS = 64


# costs over MPI: (rounds, bytes moved, bytes reduced) on the critical path, n ranks, N bytes
def _all_reduce_cost(n, N):
    return 2 * (n - 1), 2 * (n - 1) / n * N, (n - 1) / n * N


def _broadcast_cost(n, N):
    segs = max(1, min(BROADCAST_MAX_SEGMENTS, N // BROADCAST_SEGMENT_BYTES))
    steps = segs + n - 2
    return steps, steps * N / segs, 0


@schedule("ring", "all_reduce", _all_reduce_cost)
def all_reduce(size, rank, count, itemsize):
    """Reduce-scatter then all-gather around the ring, in place on "out"."""
    b = Builder()
    blocks = [Region("out", off, n) for off, n in chunks(count, size)]
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    for s in range(size - 1):  # after this loop rank r owns block r+1, fully reduced
        mine, incoming = blocks[(rank - s) % size], blocks[(rank - s - 1) % size]
        b.round(Send(nxt, mine), RecvReduce(prev, incoming, incoming))
    for s in range(size - 1):
        b.round(Send(nxt, blocks[(rank + 1 - s) % size]), Recv(prev, blocks[(rank - s) % size]))
    return b.build()


@schedule("ring", "reduce_scatter", lambda n, N: (n - 1, (n - 1) * N, (n - 1) * N))
def reduce_scatter(size, rank, count, itemsize):
    """Partial sums travel the ring; two tmp blocks alternate as receive targets."""
    b = Builder()
    inp = lambda i: Region("in", (i % size) * count, count)  # noqa: E731
    tmp = lambda s: Region("tmp", (s % 2) * count, count)  # noqa: E731
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    if size == 1:
        b.round(Copy(inp(0), Region("out", 0, count)))
    for s in range(size - 1):  # step s: forward block r-s-1, accumulate block r-s-2
        src = inp(rank - s - 1) if s == 0 else tmp(s - 1)
        last = s == size - 2
        dst = Region("out", 0, count) if last else tmp(s)
        b.round(Send(nxt, src), RecvReduce(prev, dst, inp(rank - s - 2)))
    return b.build(tmp_count=2 * count if size > 2 else 0)


@schedule("ring", "all_gather", lambda n, N: (n - 1, (n - 1) * N, 0))
def all_gather(size, rank, count, itemsize):
    b = Builder()
    block = lambda i: Region("out", (i % size) * count, count)  # noqa: E731
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    first = [Copy(Region("in", 0, count), block(rank))]
    for s in range(size - 1):
        b.round(*first, Send(nxt, block(rank - s)), Recv(prev, block(rank - s - 1)))
        first = []
    b.round(*first)
    return b.build()


@schedule("ring", "broadcast", _broadcast_cost)
def broadcast(size, rank, count, itemsize, root=0):
    """Pipelined chain root -> root+1 -> ...: segment j leaves position p in round j+p."""
    b = Builder()
    nsegs = max(1, min(BROADCAST_MAX_SEGMENTS, count * itemsize // BROADCAST_SEGMENT_BYTES))
    segs = [Region("out", off, n) for off, n in chunks(count, nsegs)]
    pos = (rank - root) % size
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    for t in range(nsegs + size - 2):
        steps = []
        if pos > 0 and 0 <= t - (pos - 1) < nsegs:
            steps.append(Recv(prev, segs[t - (pos - 1)]))
        if pos < size - 1 and 0 <= t - pos < nsegs:
            steps.append(Send(nxt, segs[t - pos]))
        b.round(*steps)
    return b.build()
