"""Choice of algorithm: an explicit name, else COMMLIB_ALGO_<COLLECTIVE>, else the cost model.

The alpha-beta-gamma model: an algorithm's cost is ``rounds*alpha + moved*beta +
reduced*gamma``, where each formula below gives (rounds, bytes moved, bytes reduced) on the
critical path for n ranks and N bytes (the per-rank count of the primary buffer). Being
linear in the constants, the model is fitted by least squares (``python -m bench
calibrate``), which writes a tuning file; without one, defaults fitted on a 2-core machine
with 2 ranks apply. ``native`` (the MPI library's own collective) is opaque: its own
alpha, and one per-byte cost per collective in place of beta and gamma.

On the shared-memory transport (one host) every byte a schedule sends or receives is a
copy (into a slot, out of one), so its terms are read off the schedule itself
(``shm_terms``: rounds, bytes copied, bytes reduced, for the busiest rank) and priced with
alpha_shm, beta_shm, gamma_shm. ``direct`` has formulas of its own (its copies cost
beta_direct): a round there is a barrier per staged piece. All alphas include the Python
call path. ``hier`` costs its host stage (direct, L ranks per host) plus its
cross-host stage (the best MPI algorithm among H hosts on 1/L of the data).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

# (import names: the package attribute commlib.algorithms is the public function)
from .algorithms import OFFERS, Algorithm, algorithms, get
from .algorithms.ring import BROADCAST_MAX_SEGMENTS, BROADCAST_SEGMENT_BYTES

STAGING_HALF_BYTES = 512 * 1024  # csrc/shm_direct.cpp stages pieces of about this size
SMALL_ALL_REDUCE_BYTES = 4096    # ... and reduces vectors up to this size with one barrier


def _log(n):  # rounds of a binomial tree / recursive doubling
    return math.ceil(math.log2(n))


def _pow2(n):  # rhd's power of two
    return 1 << (n.bit_length() - 1)


def _ring_all_reduce(n, N):
    return 2 * (n - 1), 2 * (n - 1) / n * N, (n - 1) / n * N


def _rhd_all_reduce(n, N):
    p, fold = _pow2(n), int(n != _pow2(n))
    return (2 * math.log2(p) + 2 * fold, 2 * (p - 1) / p * N + 2 * fold * N,
            (p - 1) / p * N + fold * N)


def _rhd_reduce_scatter(n, N):
    p, fold = _pow2(n), int(n != _pow2(n))
    moved = (n - 1) * N + fold * n * N
    return math.log2(p) + fold, moved, moved


def _rhd_all_gather(n, N):
    p, fold = _pow2(n), int(n != _pow2(n))
    return math.log2(p) + 2 * fold, (n - 1) * N + fold * (n + 1) * N, 0


def _chain_broadcast(n, N):
    segs = max(1, min(BROADCAST_MAX_SEGMENTS, N // BROADCAST_SEGMENT_BYTES))
    steps = segs + n - 2
    return steps, steps * N / segs, 0


# (collective, algorithm) -> (rounds, bytes moved, bytes reduced)
FORMULAS = {
    ("all_reduce", "ring"): _ring_all_reduce,
    ("all_reduce", "tree"): lambda n, N: (2 * _log(n), 2 * _log(n) * N, _log(n) * N),
    ("all_reduce", "rhd"): _rhd_all_reduce,
    ("reduce_scatter", "ring"): lambda n, N: (n - 1, (n - 1) * N, (n - 1) * N),
    ("reduce_scatter", "rhd"): _rhd_reduce_scatter,
    ("all_gather", "ring"): lambda n, N: (n - 1, (n - 1) * N, 0),
    ("all_gather", "rhd"): _rhd_all_gather,
    ("all_to_all", "pairwise"): lambda n, N: (n - 1, (n - 1) / n * N, 0),
    ("broadcast", "tree"): lambda n, N: (_log(n), _log(n) * N, 0),
    ("broadcast", "ring"): _chain_broadcast,
    ("reduce", "tree"): lambda n, N: (_log(n), _log(n) * N, _log(n) * N),
}

def _pieces(nbytes):
    return max(1, math.ceil(nbytes / STAGING_HALF_BYTES))


# direct on shared memory: (barriers, bytes copied, bytes reduced) per rank
def _direct_all_reduce(n, N):
    if N <= SMALL_ALL_REDUCE_BYTES:
        return 1, N, n * N
    return 2 * _pieces(N), N + N / n + (n - 1) / n * N, N


DIRECT_FORMULAS = {
    "all_reduce": _direct_all_reduce,
    "reduce": lambda n, N: (2 * _pieces(N), N + N / n, N),
    "reduce_scatter": lambda n, N: (_pieces(n * N), n * N, n * N),
    "all_gather": lambda n, N: (_pieces(N), n * N, 0),
    # the root stages a piece, then the others copy it: one after the other
    "broadcast": lambda n, N: (_pieces(N), 2 * N, 0),
    # the parts for peers staged and copied out, the own part copied once
    "all_to_all": lambda n, N: (_pieces(N), (2 * (n - 1) + 1) / n * N, 0),
}

@lru_cache(maxsize=2048)
def shm_terms(collective: str, name: str, n: int, nbytes: int) -> tuple:
    """(rounds, bytes copied, bytes reduced) of the busiest rank when schedule ``name``
    runs on shared memory: sends and plain receives and local copies each copy their
    bytes once; a reducing receive reduces them."""
    params = {}
    if collective in ("broadcast", "reduce"):
        params["root"] = 0
    if collective == "all_to_all":
        splits = tuple(n_ for _, n_ in _even(nbytes, n))
        params.update(input_splits=splits, output_splits=splits)
    worst = (0, 0, 0)
    for rank in range(n):
        sched = get(collective, name).build(n, rank, nbytes, 1, **params)
        copied = reduced = 0
        for rnd in sched.rounds:
            for step in rnd.steps:
                if type(step).__name__ == "RecvReduce":
                    reduced += step.dst.count
                else:
                    copied += (step.src if hasattr(step, "src") else step.dst).count
        worst = max(worst, (len(sched.rounds), copied, reduced), key=lambda t: t[1] + t[2])
    return worst


def _even(count, parts):
    base, extra = divmod(count, parts)
    return [(0, base + (i < extra)) for i in range(parts)]


# hier, L ranks on each of H hosts: per-rank bytes of its host stage and its cross stage
HIER_BYTES = {
    "all_reduce": lambda L, H, N: (N, N / L),
    "reduce_scatter": lambda L, H, N: (H * N, N),
    "all_gather": lambda L, H, N: (H * N, N),
    "broadcast": lambda L, H, N: (N, N),
}

# native: (latency rounds, bytes its traffic moves) per collective
NATIVE_FORMULAS = {
    "all_reduce": lambda n, N: (2 * _log(n), 2 * (n - 1) / n * N),
    "reduce_scatter": lambda n, N: (_log(n), (n - 1) * N),
    "all_gather": lambda n, N: (_log(n), (n - 1) * N),
    "all_to_all": lambda n, N: (n - 1, (n - 1) / n * N),
    "broadcast": lambda n, N: (_log(n), N),
    "reduce": lambda n, N: (_log(n), N),
}

TUNING_ENV = "COMMLIB_TUNING"


def tuning_path() -> Path:
    """Where the tuning file lives: $COMMLIB_TUNING, else a per-user default."""
    if os.environ.get(TUNING_ENV):
        return Path(os.environ[TUNING_ENV])
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "commlib" / "tuning.json"


@dataclass(frozen=True)
class CostModel:
    alpha: float = 6e-6         # s per round, schedules on the Python executor
    beta: float = 0.9e-10       # s per byte moved
    gamma: float = 0.2e-10      # s per byte reduced
    alpha_shm: float = 3.7e-6     # s per round (schedules) or barrier (direct) on shared memory
    beta_shm: float = 2.25e-11    # s per byte a schedule copies (into or out of a slot, locally)
    beta_direct: float = 2.0e-11  # s per byte direct copies (staging, gathers)
    gamma_shm: float = 2.76e-11   # s per byte reduced there
    alpha_native: float = 4e-6  # s per latency round of the MPI library's own collectives
    native_per_byte: tuple = field(default=(  # s per byte its traffic moves, per collective
        ("all_reduce", 3.4e-10), ("reduce_scatter", 1.6e-10), ("all_gather", 0.75e-10),
        ("all_to_all", 1.6e-10), ("broadcast", 0.3e-10), ("reduce", 7e-10)))

    def predict(self, collective: str, name: str, n: int, nbytes: int,
                transport: str | None = None, local: int | None = None) -> float:
        """Predicted seconds on ``transport`` ("shm", "mpi" or "hosts", whose hosts have
        ``local`` ranks each); inf when the model has no formula for this algorithm."""
        if name == "hier":
            return self._predict_hier(collective, n, nbytes, local or n)
        if name == "direct":
            formula = DIRECT_FORMULAS.get(collective)
            if formula is None:
                return math.inf
            rounds, moved, reduced = formula(n, nbytes)
            return rounds * self.alpha_shm + moved * self.beta_direct + reduced * self.gamma_shm
        if name == "native":
            rounds, moved = NATIVE_FORMULAS[collective](n, nbytes)
            return self.alpha_native * max(1, rounds) + moved * dict(self.native_per_byte)[collective]
        formula = FORMULAS.get((collective, name))
        if formula is None:
            return math.inf
        if transport == "shm":
            rounds, copied, reduced = shm_terms(collective, name, n, nbytes)
            return (max(rounds, 1) * self.alpha_shm + copied * self.beta_shm
                    + reduced * self.gamma_shm)
        if n == 1:
            return self.alpha
        rounds, moved, reduced = formula(n, nbytes)
        return rounds * self.alpha + moved * self.beta + reduced * self.gamma

    def _predict_hier(self, collective, n, nbytes, local):
        if collective not in HIER_BYTES or local >= n:
            return math.inf
        hosts = n // local
        host_bytes, cross_bytes = HIER_BYTES[collective](local, hosts, nbytes)
        cross = min(self.predict(collective, a, hosts, int(cross_bytes), "mpi")
                    for a in _runnable(collective, OFFERS["mpi"]))
        return self.predict(collective, "direct", local, int(host_bytes), "shm") + cross

    def save(self, path: Path | None = None) -> Path:
        path = path or tuning_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["native_per_byte"] = dict(self.native_per_byte)
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | None = None) -> "CostModel":
        """The tuning file's model, or the defaults when there is none."""
        path = path or tuning_path()
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
            data["native_per_byte"] = tuple(sorted({**dict(cls.native_per_byte),
                                                    **data.get("native_per_byte", {})}.items()))
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"tuning file {path} is unreadable ({e}); rerun "
                             f"`python -m bench calibrate` or delete it") from None


DEFAULT_MODEL = CostModel.load()


def algorithm_overrides() -> dict:
    """The COMMLIB_ALGO_<COLLECTIVE> settings; a communicator reads them when created."""
    from .algorithms import COLLECTIVES
    return {c: os.environ[f"COMMLIB_ALGO_{c.upper()}"] for c in COLLECTIVES
            if os.environ.get(f"COMMLIB_ALGO_{c.upper()}")}


def _runnable(collective: str, offers: frozenset) -> list[str]:
    return [a for a in algorithms(collective) if get(collective, a).requires in (None, *offers)]


def choose(collective: str, requested: str | None, n: int, nbytes: int,
           model: CostModel | None = None, transport: str | None = None,
           local: int | None = None, offers: frozenset | None = None) -> Algorithm:
    """The algorithm to run: ``requested`` if given, then the environment, then the model
    (among the algorithms that ``offers``, by default ``transport``'s, allow; see
    algorithms.OFFERS). Without either: what a plain MPI communicator offers."""
    offers = offers if offers is not None else OFFERS[transport or "mpi"]
    name = requested or os.environ.get(f"COMMLIB_ALGO_{collective.upper()}")
    if name and name != "auto":
        return get(collective, name, offers)
    return _cheapest(collective, n, nbytes, model or DEFAULT_MODEL, transport, local, offers)


# all_to_all's counts differ per rank, so its choice must not depend on them: every rank
# decides at this size.
ALL_TO_ALL_DECIDING_BYTES = 1 << 20


@lru_cache(maxsize=4096)
def _cheapest(collective: str, n: int, nbytes: int, model: CostModel, transport, local,
              offers: frozenset) -> Algorithm:
    if collective == "all_to_all":
        nbytes = ALL_TO_ALL_DECIDING_BYTES
    names = _runnable(collective, offers)
    return get(collective, min(names, key=lambda nm: (
        model.predict(collective, nm, n, nbytes, transport, local), nm)))
