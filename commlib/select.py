"""Choice of algorithm: an explicit name, else COMMLIB_ALGO_<COLLECTIVE>, else the cost model.

The alpha-beta-gamma model: a round costs alpha (latency, per message posted together),
moving b bytes costs b*beta, reducing b bytes costs b*gamma. ``native`` (the MPI library's
C implementation) has less latency than a schedule run by the Python executor and its own
per-byte cost per collective. Defaults fitted to runs with 2 ranks on a 2-core machine
(bench/all_reduce_sweep.py and the same sweep for the other collectives).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

# (import names: the package attribute commlib.algorithms is the public function)
from .algorithms import Algorithm, algorithms, get
from .algorithms.ring import BROADCAST_MAX_SEGMENTS, BROADCAST_SEGMENT_BYTES


@dataclass(frozen=True)
class _Size:
    """World-size terms shared by the formulas."""
    n: int

    @property
    def log(self):  # rounds of a binomial tree / recursive doubling
        return math.ceil(math.log2(self.n))

    @property
    def p(self):  # rhd's power of two
        return 1 << (self.n.bit_length() - 1)

    @property
    def fold(self):  # rhd's extra step for non-powers of two
        return int(self.n != self.p)

    @property
    def frac(self):
        return (self.n - 1) / self.n


def _chain(s, a, b, N):
    segs = max(1, min(BROADCAST_MAX_SEGMENTS, N // BROADCAST_SEGMENT_BYTES))
    return (segs + s.n - 2) * (a + N / segs * b)


# (collective, algorithm) -> seconds for N bytes (per-rank count of the primary buffer)
_FORMULAS = {
    ("all_reduce", "ring"): lambda s, a, b, g, N: 2 * (s.n - 1) * a + s.frac * N * (2 * b + g),
    ("all_reduce", "tree"): lambda s, a, b, g, N: s.log * (2 * a + N * (2 * b + g)),
    ("all_reduce", "rhd"): lambda s, a, b, g, N: (2 * math.log2(s.p) * a
                                                 + (s.p - 1) / s.p * N * (2 * b + g)
                                                 + s.fold * (2 * (a + N * b) + N * g)),
    ("reduce_scatter", "ring"): lambda s, a, b, g, N: (s.n - 1) * (a + N * (b + g)),
    ("reduce_scatter", "rhd"): lambda s, a, b, g, N: (math.log2(s.p) * a + (s.n - 1) * N * (b + g)
                                                     + s.fold * (a + s.n * N * (b + g))),
    ("all_gather", "ring"): lambda s, a, b, g, N: (s.n - 1) * (a + N * b),
    ("all_gather", "rhd"): lambda s, a, b, g, N: (s.log * a + (s.n - 1) * N * b
                                                 + s.fold * (a + s.n * N * b)),
    ("all_to_all", "pairwise"): lambda s, a, b, g, N: (s.n - 1) * a + s.frac * N * b,
    ("broadcast", "tree"): lambda s, a, b, g, N: s.log * (a + N * b),
    ("broadcast", "ring"): lambda s, a, b, g, N: _chain(s, a, b, N),
    ("reduce", "tree"): lambda s, a, b, g, N: s.log * (a + N * (b + g)),
}

# The MPI library's collectives are opaque: latency rounds, and a per-byte cost of its own
# per collective, in units of the bytes its bus traffic moves (fitted to MPICH 5, 2 ranks,
# shared memory; MPICH reduces slowly in all_reduce and reduce, moves data fast in bcast).
_NATIVE = {  # collective: (rounds as a function of s, bytes moved, seconds per byte)
    "all_reduce": (lambda s: 2 * s.log, lambda s, N: 2 * s.frac * N, 3.4e-10),
    "reduce_scatter": (lambda s: s.log, lambda s, N: (s.n - 1) * N, 1.6e-10),
    "all_gather": (lambda s: s.log, lambda s, N: (s.n - 1) * N, 0.75e-10),
    "all_to_all": (lambda s: s.n - 1, lambda s, N: s.frac * N, 1.6e-10),
    "broadcast": (lambda s: s.log, lambda s, N: N, 0.3e-10),
    "reduce": (lambda s: s.log, lambda s, N: N, 7e-10),
}


@dataclass(frozen=True)
class CostModel:
    alpha: float = 6e-6         # s per round, schedules on the Python executor
    beta: float = 0.9e-10       # s per byte moved
    gamma: float = 0.2e-10      # s per byte reduced
    alpha_native: float = 4e-6  # s per round of the MPI library's own collectives

    def predict(self, collective: str, name: str, n: int, nbytes: int) -> float:
        """Predicted seconds; inf when the model has no formula for this algorithm."""
        if name == "native":
            rounds, moved, per_byte = _NATIVE[collective]
            s = _Size(n)
            return self.alpha_native * max(1, rounds(s)) + moved(s, nbytes) * per_byte
        formula = _FORMULAS.get((collective, name))
        if formula is None:
            return math.inf
        if n == 1:
            return self.alpha
        return formula(_Size(n), self.alpha, self.beta, self.gamma, nbytes)


DEFAULT_MODEL = CostModel()


def choose(collective: str, requested: str | None, n: int, nbytes: int,
           model: CostModel = DEFAULT_MODEL) -> Algorithm:
    """The algorithm to run: ``requested`` if given, then the environment, then the model."""
    name = requested or os.environ.get(f"COMMLIB_ALGO_{collective.upper()}")
    if name and name != "auto":
        return get(collective, name)
    return _cheapest(collective, n, nbytes, model)


@lru_cache(maxsize=4096)
def _cheapest(collective: str, n: int, nbytes: int, model: CostModel) -> Algorithm:
    names = algorithms(collective)
    return get(collective, min(names, key=lambda nm: (model.predict(collective, nm, n, nbytes), nm)))
