"""Pairwise exchange all_to_all: in step k rank r sends to r+k and receives from r-k.

Splits are element counts per peer (like torch's all_to_all_single); each rank's schedule
depends only on its own splits, which must agree with its peers'.
"""
from itertools import accumulate

from ..schedule import Builder, Copy, Recv, Region, Send
from .registry import schedule


@schedule("pairwise", "all_to_all", lambda n, N: (n - 1, (n - 1) / n * N, 0))
def all_to_all(size, rank, count, itemsize, input_splits, output_splits):
    b = Builder()
    in_off = [0, *accumulate(input_splits)]
    out_off = [0, *accumulate(output_splits)]
    part = lambda buf, off, i: Region(buf, off[i], off[i + 1] - off[i])  # noqa: E731
    # The own part travels with the first exchange, so an executor can copy it while it
    # waits for the peer.
    own = [Copy(part("in", in_off, rank), part("out", out_off, rank))]
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        b.round(*own, Send(to, part("in", in_off, to)), Recv(frm, part("out", out_off, frm)))
        own = []
    b.round(*own)  # a single rank
    return b.build()
