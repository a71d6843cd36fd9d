"""Choice of algorithm: an explicit name, else COMMLIB_ALGO_<COLLECTIVE>, else the cheapest.

Every registry entry (commlib/algorithms/) prices itself as terms linear in CostModel's
constants (``rounds*alpha + moved*beta + reduced*gamma`` and kin), so the model is fitted
by least squares (``commlib-bench calibrate``, which writes a tuning file; without one,
defaults fitted on a 2-core machine with 2 ranks apply).

A call on GPU arrays takes the cheapest algorithm that works on the device memory itself
where one applies, else a host one, staged (staging's copies, never measured, are unpriced).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from . import settings
from .algorithms import Algorithm, candidates, unavailable
from .algorithms.pages import by_pages, in_regions, worth_deciding_by_pages, \
    worth_reading_regions
from .collectives import COLLECTIVES, REDUCING, of as collective_of
from .transports.base import Where

def tuning_path() -> Path:
    """Where the tuning file lives: $COMMLIB_TUNING (unless off or refresh: see
    commlib/tuning.py), else a per-user default."""
    said = settings.get("COMMLIB_TUNING")
    if said.lower() not in ("", "off", "refresh"):
        return Path(said)
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
    beta_one_copy: float = 4.0e-11  # s per byte one_copy reads from a peer (process_vm_readv)
    gamma_shm: float = 2.76e-11   # s per byte reduced there
    alpha_native: float = 4e-6  # s per latency round of the MPI library's own collectives
    alpha_gloo: float = 50e-6  # gloo's, between torchrun's nodes (never fitted: its TCP's)
    beta_gloo: float = 1e-9
    native_per_byte: tuple = field(default=(  # s per byte its traffic moves, per collective
        ("all_reduce", 3.4e-10), ("reduce_scatter", 1.6e-10), ("all_gather", 0.75e-10),
        ("all_to_all", 1.6e-10), ("broadcast", 0.3e-10), ("reduce", 7e-10)))
    # on GPU arrays, never measured (no GPU yet): CUDA IPC's s per step through the slots
    # and per byte moved; what MPI's own call on device memory adds (stream, device)
    alpha_ipc: float = 5e-6
    beta_ipc: float = 1e-12
    alpha_cuda_mpi: float = 20e-6

    def constant(self, name: str) -> float:
        """A constant by the name cost terms use; "native:<collective>" for MPI's per-byte."""
        if name.startswith("native:"):
            return dict(self.native_per_byte)[name.removeprefix("native:")]
        return getattr(self, name)

    def price(self, terms: dict) -> float:
        return sum(coefficient * self.constant(name) for name, coefficient in terms.items())

    def predict(self, collective: str, name: str, n: int, nbytes: int,
                transport: str | None = None, local: int | None = None) -> float:
        """Predicted seconds of host algorithm ``name`` on ``transport`` ("shm", "mpi" or
        "hosts", whose hosts have ``local`` ranks each); inf when it cannot run there."""
        from .algorithms import entries
        algo = entries(collective)[name]
        return self.cost(algo, Where(transport or "mpi", local), n, nbytes)

    def cost(self, algo: Algorithm, where: Where, n: int, nbytes: int) -> float:
        terms = algo.cost(self, where, n, nbytes)
        return math.inf if terms is None else self.price(terms)

    def save(self, path: Path | None = None) -> Path:
        path = path or tuning_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["native_per_byte"] = dict(self.native_per_byte)
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | None = None) -> "CostModel":
        """The tuning file's model, or the defaults when there is none (or tuning is off)."""
        path = path or tuning_path()
        if settings.get("COMMLIB_TUNING").lower() == "off" or not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
            data["native_per_byte"] = tuple(sorted({**dict(cls.native_per_byte),
                                                    **data.get("native_per_byte", {})}.items()))
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"tuning file {path} is unreadable ({e}); rerun "
                             f"`commlib-bench calibrate` or delete it") from None


@lru_cache(maxsize=None)
def default_model() -> CostModel:
    """The tuning file's model, read once, when a choice first needs it (not at import)."""
    return CostModel.load()


def algorithm_overrides() -> dict:
    """The COMMLIB_ALGO_<COLLECTIVE> settings; a communicator reads them when created."""
    said = {c: settings.get(f"COMMLIB_ALGO_{c.upper()}") for c in COLLECTIVES}
    return {c: name for c, name in said.items() if name}


# all_to_all's counts differ per rank, so its choice must not depend on them: every rank
# decides at this size (the cost model), or by the measured table over all sizes.
ALL_TO_ALL_DECIDING_BYTES = 1 << 20


def choose(collective: str, requested: str | None, n: int, nbytes: int,
           model: CostModel | None = None, transport: str | None = None,
           local: int | None = None, offers: frozenset | None = None,
           where: Where | None = None, measured=None, user_op: bool = False,
           deterministic: bool = False, regions: bool = False) -> Algorithm:
    """The algorithm for a call on host memory: ``requested``, then the environment, then
    the fastest that ``offers`` allows (default: the transport's own and MPI's) in the
    ``measured`` table (commlib/tuning.py; where its fastest on huge pages differs, the two
    by the call's memory, and where the communicator has handed out ``regions`` of memory
    every rank maps, one_copy there: algorithms/pages.py), else the cheapest by the model at
    ``where`` (else ``transport``, default mpi, with ``local`` ranks per host). A call with
    a ``user_op`` takes only algorithms that run one; a ``deterministic`` one only those
    that reduce in rank order (Algorithm.rank_order)."""
    where = where or Where(transport or "mpi", local)
    if offers is None:
        offers = frozenset({where.transport, "mpi", "schedules"})
    deterministic = deterministic and collective in REDUCING
    name = requested or settings.get(f"COMMLIB_ALGO_{collective.upper()}")
    if name and name != "auto":
        found = [a for a in candidates(collective, offers) if a.name == name]
        if not found:
            raise unavailable(collective, name, offers, False)
        why = (found[0].refuses and found[0].refuses(n, nbytes, where)) or \
            _lacks(found[0], user_op, deterministic)
        if why:
            raise ValueError(f"{collective}: algorithm={name!r} cannot run this call: {why}")
        return found[0]
    uneven = collective_of(collective).uneven
    if uneven:
        nbytes = ALL_TO_ALL_DECIDING_BYTES
    fits = [a for a in candidates(collective, offers) if not _lacks(a, user_op, deterministic)]
    if not fits:
        raise ValueError(f"{collective}: no algorithm here can run this call: "
                         f"{_lacks(None, user_op, deterministic)}")
    if measured is not None:
        found = {a.name: a for a in runnable(collective, n, nbytes, where, offers, user_op,
                                             deterministic)}
        size = None if uneven else nbytes
        base = measured.fastest(collective, size, found)
        if base is not None:
            chosen = found[base]
            huge = measured.fastest(collective, size, found, memory="huge")
            if huge not in (None, base) and worth_deciding_by_pages(
                    measured, collective, n, size, found[base], found[huge]):
                chosen = by_pages(found[huge], found[base],  # the call's memory decides
                                  collective in measured.base_pages_in_place)
            if regions and "one_copy" in found and worth_reading_regions(
                    measured, collective, size, chosen):
                return in_regions(found["one_copy"], chosen)
            return chosen
    if user_op or deterministic:
        model = model or default_model()
        return min(fits, key=lambda a: (model.cost(a, where, n, nbytes), a.name))
    return _cheapest(collective, n, nbytes, model or default_model(), where, offers)


def runnable(collective: str, n: int, nbytes: int, where: Where, offers: frozenset | None,
             user_op: bool = False, deterministic: bool = False) -> list[Algorithm]:
    """The host entries that ``offers`` allows and that can run a call of ``nbytes`` primary
    bytes among ``n`` ranks at ``where``: none refusing its size, its user-defined op, or
    the rank order of deterministic mode."""
    deterministic = deterministic and collective in REDUCING
    return [a for a in candidates(collective, offers)
            if not _lacks(a, user_op, deterministic)
            and not (a.refuses and a.refuses(n, nbytes, where))]


class Choice:
    """How one transport's calls choose their algorithm (``choice(call, requested)``): as
    ``choose`` does, with COMMLIB_ALGO_<COLLECTIVE> as set when it was made and the measured
    table once one is used; each call shape's (algorithm, plan) cached."""

    def __init__(self, transport):
        self.transport = transport
        self.overrides = algorithm_overrides()
        self.measured = None  # this layout's table.Table, once used
        self.regions = False  # whether the communicator has handed out shared regions
        self._plans: dict = {}

    def use(self, table) -> None:
        """Choose by ``table`` (table.Table, or None) from now on, not as before it."""
        self.measured = table
        self._plans.clear()

    def see_regions(self) -> None:
        """The communicator has handed out memory every rank maps (Communicator.empty):
        from now on calls may lie in it, and auto weighs one_copy there (pages.py)."""
        self.regions = True
        self._plans.clear()

    def __call__(self, call, requested: str | None = None, teaching: bool = False):
        """(algorithm, plan or None, whether to teach it) for ``call`` asked for
        ``requested`` (None: COMMLIB_ALGO_<COLLECTIVE>, else auto), cached per call shape.
        Only a ``teaching`` caller (the dispatcher, which teaches the fast path) is told to
        teach a shape, once: inner calls (ordered's stages, staging) share the cache but
        must not use up that turn, or the shape would stay on the general path for good."""
        t = self.transport
        user_op = call.op is not None and not call.op.builtin
        key = (call.collective, requested, call.count, call.dtype.itemsize, call.params,
               user_op, t.rank_order)
        hit = self._plans.get(key)
        if hit is None:
            algo = choose(call.collective,
                          requested or self.overrides.get(call.collective, "auto"),
                          t.size, call.nbytes, where=t.where, offers=t.offers,
                          measured=self.measured, user_op=user_op,
                          deterministic=t.rank_order, regions=self.regions)
            plan = None if algo.run is not None else t.plan(algo, call)
            if len(self._plans) >= 4096:
                self._plans.clear()
            hit = self._plans[key] = [algo, plan, False]
        teach = teaching and not hit[2]
        if teaching:
            hit[2] = True
        return hit[0], hit[1], teach

    @classmethod
    def give(cls, transport) -> None:
        """A choice to ``transport`` and to each transport it runs stages on."""
        transport.choice = cls(transport)
        for part in transport.parts():
            cls.give(part)


def _lacks(algo: Algorithm | None, user_op: bool, deterministic: bool) -> str | None:
    """Why ``algo`` (None: any) cannot run a call that needs these, or None."""
    if user_op and (algo is None or not algo.user_ops):
        return "it does not run user-defined reduce ops (the schedules and direct do)"
    if deterministic and (algo is None or not algo.rank_order):
        return ("deterministic mode needs an algorithm that reduces in rank order "
                "(direct, one_copy, eager, ordered)")
    return None


def choose_on_device(call, requested: str | None, n: int, where: Where, offers: frozenset,
                     on=None, model: CostModel | None = None) -> Algorithm | None:
    """The cheapest algorithm that works on ``call``'s GPU arrays themselves (``on``: the
    CUDA IPC transport) and is ``requested`` (a name or family; None: any), or None (staged
    through host memory instead); raises where only GPU algorithms are named and none fits."""
    device = [a for a in candidates(call.collective, offers, device=True) if a.memory == "device"
              and (requested is None or requested in (a.name, a.family))]
    fits = [a for a in device if a.applies is None or a.applies(on, call) is None]
    if not fits:
        if requested is None or requested in {a.name for a in candidates(call.collective,
                                                                      offers)}:
            return None
        why = next((a.applies(on, call) for a in device if a.applies), None)
        raise unavailable(call.collective, requested, offers, True, why)
    model = model or default_model()
    return min(fits, key=lambda a: (model.cost(a, where, n, call.nbytes), a.name))


@lru_cache(maxsize=4096)
def _cheapest(collective: str, n: int, nbytes: int, model: CostModel, where: Where,
              offers: frozenset | None) -> Algorithm:
    return min(candidates(collective, offers),
               key=lambda a: (model.cost(a, where, n, nbytes), a.name))
