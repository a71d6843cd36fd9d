"""Choice of algorithm: an explicit name, else COMMLIB_ALGO_<COLLECTIVE>, else the cost model.

The alpha-beta-gamma model: a round costs alpha (latency, per message posted together),
moving b bytes costs b*beta, reducing b bytes costs b*gamma. ``native`` (the MPI library's
C implementation) pays a much smaller alpha than a schedule run by the Python executor.
The constants are rough defaults for one host over shared memory.
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
    ("all_reduce", "native"): lambda s, a, b, g, N: 2 * s.log * a + s.frac * N * (2 * b + g),
    ("reduce_scatter", "ring"): lambda s, a, b, g, N: (s.n - 1) * (a + N * (b + g)),
    ("reduce_scatter", "rhd"): lambda s, a, b, g, N: (math.log2(s.p) * a + (s.n - 1) * N * (b + g)
                                                     + s.fold * (a + s.n * N * (b + g))),
    ("reduce_scatter", "native"): lambda s, a, b, g, N: s.log * a + (s.n - 1) * N * (b + g),
    ("all_gather", "ring"): lambda s, a, b, g, N: (s.n - 1) * (a + N * b),
    ("all_gather", "rhd"): lambda s, a, b, g, N: (s.log * a + (s.n - 1) * N * b
                                                 + s.fold * (a + s.n * N * b)),
    ("all_gather", "native"): lambda s, a, b, g, N: s.log * a + (s.n - 1) * N * b,
    ("all_to_all", "pairwise"): lambda s, a, b, g, N: (s.n - 1) * a + s.frac * N * b,
    ("all_to_all", "native"): lambda s, a, b, g, N: (s.n - 1) * a + s.frac * N * b,
    ("broadcast", "tree"): lambda s, a, b, g, N: s.log * (a + N * b),
    ("broadcast", "ring"): lambda s, a, b, g, N: _chain(s, a, b, N),
    ("broadcast", "native"): lambda s, a, b, g, N: s.log * a + 2 * N * b,
    ("reduce", "tree"): lambda s, a, b, g, N: s.log * (a + N * (b + g)),
    ("reduce", "native"): lambda s, a, b, g, N: s.log * a + N * (2 * b + g),
}


@dataclass(frozen=True)
class CostModel:
    alpha: float = 25e-6        # s per round, schedules on the Python executor
    alpha_native: float = 3e-6  # s per round, the MPI library's own collectives
    beta: float = 1 / 6e9       # s per byte moved
    gamma: float = 1 / 10e9     # s per byte reduced

    def predict(self, collective: str, name: str, n: int, nbytes: int) -> float:
        """Predicted seconds; inf when the model has no formula for this algorithm."""
        formula = _FORMULAS.get((collective, name))
        if formula is None:
            return math.inf
        alpha = self.alpha_native if name == "native" else self.alpha
        if n == 1:
            return alpha
        return formula(_Size(n), alpha, self.beta, self.gamma, nbytes)


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
