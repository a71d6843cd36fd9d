"""direct: host-only collectives that read the peers' published data in place
(csrc/shm_direct.cpp, through ShmComm.direct). Every rank copies its input into shared
memory once and reads what it needs straight from the others: no chain of n-1 steps, one
barrier or two per piece (a piece is what fits in half the transport's staging area).
all_to_all reads a rank's parts where they lie instead, where they take several pieces
and lie on huge pages (csrc/shm_direct.cpp).
"""
import math

from .. import _C
from ..collectives import COLLECTIVES
from .registry import register


def _pieces(nbytes, where):
    return max(1, math.ceil(nbytes / (where.staging_bytes // 2)))


def _all_reduce(n, N, where):
    if N <= min(_C.SMALL_ALL_REDUCE_BYTES, where.staging_bytes // 2):
        return 1, N, n * N
    return 2 * _pieces(N, where), N + N / n + (n - 1) / n * N, N


# (barriers, bytes copied, bytes reduced) per rank
FORMULAS = {
    "all_reduce": _all_reduce,
    "reduce": lambda n, N, w: (2 * _pieces(N, w), N + N / n, N),
    "reduce_scatter": lambda n, N, w: (_pieces(n * N, w), n * N, n * N),
    "all_gather": lambda n, N, w: (_pieces(N, w), n * N, 0),
    # the root stages a piece, then the others copy it: one after the other
    "broadcast": lambda n, N, w: (_pieces(N, w), 2 * N, 0),
    # the parts for peers staged and copied out, the own part copied once
    "all_to_all": lambda n, N, w: (_pieces(N, w), (2 * (n - 1) + 1) / n * N, 0),
}


def terms(collective, where, n, nbytes) -> dict:
    rounds, moved, reduced = FORMULAS[collective](n, nbytes, where)
    return {"alpha_shm": rounds, "beta_direct": moved, "gamma_shm": reduced}


def run(transport, call):
    transport.direct(call)


for _collective in COLLECTIVES:
    register("direct", _collective, lambda model, where, n, nbytes, c=_collective:
             terms(c, where, n, nbytes), run=run, needs="shm", agrees=True, rank_order=True)
