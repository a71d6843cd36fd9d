"""Recursive halving / doubling over the largest power of two p <= n.

Non-power-of-two sizes *fold* first: of the first 2(n-p) ranks, each even rank hands its
data to its odd neighbour and sits out; the p remaining ranks are *virtual* ranks
0..p-1 (odd rank 2v+1 is v for v < n-p, rank v+(n-p) otherwise). Halving: at distance d
= p/2, p/4, .., 1 a virtual rank swaps half of its current range with v^d and keeps the
half its bit selects. Doubling runs the same exchange in reverse, growing the range.
"""
import math

from ..schedule import Builder, Copy, Recv, RecvReduce, Region, Send, chunks
from .registry import schedule


# costs over MPI: (rounds, bytes moved, bytes reduced) on the critical path, n ranks, N bytes
def _fold(n):
    """(the power of two p, whether n folds onto it)"""
    p = 1 << (n.bit_length() - 1)
    return p, int(n != p)


def _all_reduce_cost(n, N):
    p, fold = _fold(n)
    return (2 * math.log2(p) + 2 * fold, 2 * (p - 1) / p * N + 2 * fold * N,
            (p - 1) / p * N + fold * N)


def _reduce_scatter_cost(n, N):
    p, fold = _fold(n)
    moved = (n - 1) * N + fold * n * N
    return math.log2(p) + fold, moved, moved


def _all_gather_cost(n, N):
    p, fold = _fold(n)
    return math.log2(p) + 2 * fold, (n - 1) * N + fold * (n + 1) * N, 0


class _Fold:
    def __init__(self, size, rank):
        self.size = size
        self.p = 1 << (size.bit_length() - 1)
        self.extra = size - self.p
        folded = rank < 2 * self.extra
        self.sits_out = folded and rank % 2 == 0           # hands off to rank + 1
        self.absorbs = folded and rank % 2 == 1            # receives from rank - 1
        self.v = rank // 2 if folded else rank - self.extra

    def real(self, v):
        return 2 * v + 1 if v < self.extra else v + self.extra

    def first_block(self, v):
        """Index of the first real-rank block virtual rank v owns (two blocks if it absorbed);
        first_block(p) is the end of the last one."""
        if v == self.p:
            return self.size
        return 2 * v if v < self.extra else v + self.extra

    def distances(self):
        d = self.p // 2
        while d:
            yield d
            d //= 2


def _halves(lo, hi, v, d):
    """(kept, given) virtual-rank ranges when v splits [lo, hi) with partner v ^ d."""
    mid = (lo + hi) // 2
    return ((lo, mid), (mid, hi)) if not v & d else ((mid, hi), (lo, mid))


@schedule("rhd", "all_reduce", _all_reduce_cost)
def all_reduce(size, rank, count, itemsize):
    """Rabenseifner: halving reduce-scatter + doubling all-gather, in place on "out"."""
    b, f = Builder(), _Fold(size, rank)
    whole = Region("out", 0, count)
    if f.sits_out:
        b.round(Send(rank + 1, whole))
        b.round(Recv(rank + 1, whole))
        return b.build()
    if f.absorbs:
        b.round(RecvReduce(rank - 1, whole, whole))
    blocks = chunks(count, f.p)
    span = lambda lo, hi: Region("out", blocks[lo][0], sum(n for _, n in blocks[lo:hi]))  # noqa
    lo, hi = 0, f.p
    for d in f.distances():
        (klo, khi), (glo, ghi) = _halves(lo, hi, f.v, d)
        peer = f.real(f.v ^ d)
        b.round(Send(peer, span(glo, ghi)), RecvReduce(peer, span(klo, khi), span(klo, khi)))
        lo, hi = klo, khi
    for d in reversed(list(f.distances())):
        plo, phi = (hi, hi + (hi - lo)) if not f.v & d else (lo - (hi - lo), lo)
        peer = f.real(f.v ^ d)
        b.round(Send(peer, span(lo, hi)), Recv(peer, span(plo, phi)))
        lo, hi = min(lo, plo), max(hi, phi)
    if f.absorbs:
        b.round(Send(rank - 1, whole))
    return b.build()


@schedule("rhd", "reduce_scatter", _reduce_scatter_cost)
def reduce_scatter(size, rank, count, itemsize):
    """Halving over virtual ranks, each owning the blocks of the real ranks it stands for.

    The input stays untouched: partial sums live in tmp; the last step writes "out".
    """
    b, f = Builder(), _Fold(size, rank)
    out = Region("out", 0, count)
    span = lambda buf, lo, hi: Region(buf, f.first_block(lo) * count,  # noqa: E731
                                      (f.first_block(hi) - f.first_block(lo)) * count)
    if f.sits_out:
        b.round(Send(rank + 1, Region("in", 0, size * count)))
        b.round(Recv(rank + 1, out))
        return b.build()
    acc = "in"
    if f.absorbs:
        b.round(RecvReduce(rank - 1, Region("tmp", 0, size * count), Region("in", 0, size * count)))
        acc = "tmp"
    lo, hi = 0, f.p
    for d in f.distances():
        (klo, khi), (glo, ghi) = _halves(lo, hi, f.v, d)
        peer = f.real(f.v ^ d)
        kept = span("tmp", klo, khi)
        if d == 1 and not f.absorbs:  # the kept range is exactly this rank's own block
            kept = out
        b.round(Send(peer, span(acc, glo, ghi)), RecvReduce(peer, kept, span(acc, klo, khi)))
        acc, lo, hi = "tmp", klo, khi
    own = f.first_block(f.v)
    if f.absorbs:  # two blocks: the sitting-out neighbour's and ours
        b.round(Copy(Region(acc, (own + 1) * count, count), out),
                Send(rank - 1, Region(acc, own * count, count)))
    elif f.p == 1:
        b.round(Copy(Region("in", 0, count), out))
    return b.build(tmp_count=size * count if size > 1 else 0)


@schedule("rhd", "all_gather", _all_gather_cost)
def all_gather(size, rank, count, itemsize):
    """Recursive doubling; folded ranks get the full result from their neighbour at the end."""
    b, f = Builder(), _Fold(size, rank)
    span = lambda lo, hi: Region("out", f.first_block(lo) * count,  # noqa: E731
                                 (f.first_block(hi) - f.first_block(lo)) * count)
    whole = Region("out", 0, size * count)
    mine = Copy(Region("in", 0, count), Region("out", rank * count, count))
    if f.sits_out:
        b.round(Send(rank + 1, Region("in", 0, count)))
        b.round(Recv(rank + 1, whole))
        return b.build()
    first = [mine]
    if f.absorbs:
        b.round(mine, Recv(rank - 1, Region("out", (rank - 1) * count, count)))
        first = []
    lo, hi = f.v, f.v + 1
    for d in reversed(list(f.distances())):
        plo, phi = (hi, hi + (hi - lo)) if not f.v & d else (lo - (hi - lo), lo)
        peer = f.real(f.v ^ d)
        b.round(*first, Send(peer, span(lo, hi)), Recv(peer, span(plo, phi)))
        first = []
        lo, hi = min(lo, plo), max(hi, phi)
    b.round(*first)
    if f.absorbs:
        b.round(Send(rank - 1, whole))
    return b.build()

