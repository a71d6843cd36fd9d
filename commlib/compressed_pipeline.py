"""A compressed all_reduce's pipeline over its pieces, whatever encodes and decodes them
(commlib/compressed.py on host memory, commlib/compressed_device.py on a GPU's).

    piece     wire.PIECE elements of the data (cut_pieces), each cut in n parts, part j
              rank j's to sum (wire.parts).
    exchange  a piece's parts encoded (the codec), an all_to_all of the packets started.
    reduce    the oldest exchange waited for; this rank's part of every rank summed and
              encoded again (Wire.sum_encode, with the server residual), its all_gather
              started.
    decode    the oldest gather waited for; every part decoded into the piece (the codec).

At most two pieces are in each stage at once, so one piece is encoded or decoded while
the ones before it are on the wire. The async calls go in the same order on every rank.

A codec has encode(start, count, cut) -> (host packets, their width: part j at j x width)
and decode(start, cut, width, gathered), each for the piece of ``count`` elements at
``start``.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .wire import Wire, exchange_algorithm, parts


def all_reduce(comm, wire: Wire, pieces: list, codec, server, server_at: list,
               factor: float) -> None:
    """The pipeline over ``pieces`` (start, count); ``server`` the server residual (this
    rank's part of each piece, one after the other, piece i at server_at[i]) or None."""
    n, rank = comm.size, comm.rank
    algorithm = exchange_algorithm(comm)
    exchanging, gathering = deque(), deque()

    def exchange(i):
        start, count = pieces[i]
        cut = parts(count, n)
        packets, width = codec.encode(start, count, cut)
        got = np.empty(n * width, np.uint8)
        exchanging.append((i, cut, width, got, packets, comm.all_to_all(
            got, packets, async_op=True, algorithm=algorithm)))

    def reduce():
        i, cut, width, got, _, work = exchanging.popleft()
        work.wait()
        packet = np.zeros(width, np.uint8)
        wire.sum_encode(packet, [got.ctypes.data + j * width for j in range(n)],
                        cut[rank][1], None if server is None else
                        server[server_at[i]:server_at[i + 1]], factor)
        gathered = np.empty(n * width, np.uint8)
        gathering.append((i, cut, width, gathered, packet,
                          comm.all_gather(gathered, packet, async_op=True)))

    def decode():
        i, cut, width, gathered, _, work = gathering.popleft()
        work.wait()
        codec.decode(pieces[i][0], cut, width, gathered)

    for i in range(len(pieces)):
        exchange(i)
        if len(exchanging) > 1:
            reduce()
        if len(gathering) > 1:
            decode()
    while exchanging:
        reduce()
    while gathering:
        decode()
