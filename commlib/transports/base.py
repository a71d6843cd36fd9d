"""The interface every transport implements. Its *world* is how its ranks met (MpiWorld,
StoreWorld): ``allgather`` exchanges set-up facts as JSON, ``send``/``recv`` move
messages, ``split``/``dup`` make new worlds."""
from __future__ import annotations

import os

import numpy as np

from .. import _C
from ..buffers import Buffer
from ..algorithms import Where
from ..select import algorithm_overrides, choose


class Transport:
    """What one communicator's collectives run over. A subclass sets ``name`` (what costs
    see), ``offers`` (the capabilities algorithm entries need) and ``suits(world)``
    (whether auto picks it), and implements ``agree(desc, splits, itemsize)`` (every rank
    made the call ``desc`` describes, else all raise CollectiveMismatchError),
    ``barrier()``, ``plan(algo, call)`` and ``run_plan(plan, call)`` (a schedule compiled
    for its executor, and run), and ``bytes_sent``. Every wait is bounded by ``timeout``;
    a failed call fails alike on every rank. Runners call its own methods (direct, hier's
    stages, native's MPI communicator)."""

    name: str
    offers: frozenset
    # where algorithms read the peers' memory in place (shm), how (tuning.py measures it):
    # the collectives whose buffers on base pages are read in place too, else staged, and
    # the bytes of a part from which direct's all_to_all reads parts in place; None where
    # none do
    base_pages_in_place = None
    parts_in_place_from = None

    def __init__(self, world):
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.timeout = 0.0  # seconds a call may wait for its peers (0: forever)
        self.where = Where(self.name)  # what its algorithms' costs depend on
        # whether calls are checked for agreement at all (a rank whose arguments are invalid
        # then tells its peers)
        self.checks_calls = True
        self._overrides = algorithm_overrides()
        self._plans: dict = {}
        self.measured = None  # this layout's tuning.Table, once attached
        self.memory = None  # host_memory.SharedHostMemory where the ranks share memory
        self._scratch: dict = {}
        # reducing calls take only algorithms that reduce in rank order (Algorithm.rank_order)
        self.deterministic = os.environ.get("COMMLIB_DETERMINISTIC", "0") not in ("", "0")

    @property
    def rank_order(self) -> bool:
        """Whether reducing calls must take algorithms that reduce in rank order:
        deterministic mode among 3 ranks or more (between 2, every algorithm applies the op
        once per element, and the ops commute: the same bits whatever runs it)."""
        return self.deterministic and self.size > 2

    def scratch(self, slot, numel: int, dtype) -> Buffer:
        """Reused working buffer ``slot`` (a key each algorithm keeps its own), for
        algorithms built from others (fresh pages would cost more than their copies)."""
        nbytes = numel * dtype.itemsize
        raw = self._scratch.get(slot)
        if raw is None or raw.size < nbytes:
            raw = self._scratch[slot] = np.empty(nbytes, np.uint8)
        return Buffer(raw, raw.ctypes.data, numel, dtype, raw[:nbytes])

    def agree_call(self, call, algo) -> None:
        """Agree on ``call`` before ``algo`` runs it, unless running it checks that itself
        or calls go unchecked (COMMLIB_CHECK=0, where a transport allows it)."""
        if self.checks_calls and not algo.agrees:
            self.agree(call.descriptor(algo.name), call.split_bytes(), call.dtype.itemsize)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds

    fast_kinds = frozenset()  # the entries its fast path runs (csrc/fast_path.h)

    def fast_path(self, **kwargs):
        """A C++ fast path for this transport's calls (commlib/fast_path.py), or None."""
        return None

    def device_offers(self) -> frozenset:
        """What calls on GPU arrays may use here beyond ``offers`` (a CUDA-aware MPI)."""
        return frozenset()

    def close(self) -> None:
        self.world.close()

    def choose(self, call, requested: str | None, teaching: bool = False):
        """(algorithm, plan or None, whether to teach it) for ``call`` asked for
        ``requested`` (None: COMMLIB_ALGO_<COLLECTIVE>, else auto), cached per call shape.
        Only a ``teaching`` caller (the dispatcher, which teaches the fast path) is told to
        teach a shape, once: inner calls (ordered's stages, staging) share the cache but
        must not use up that turn, or the shape would stay on the general path for good."""
        user_op = call.op is not None and not call.op.builtin
        key = (call.collective, requested, call.count, call.dtype.itemsize, call.params,
               user_op, self.rank_order)
        hit = self._plans.get(key)
        if hit is None:
            algo = choose(call.collective,
                          requested or self._overrides.get(call.collective, "auto"),
                          self.size, call.nbytes, where=self.where, offers=self.offers,
                          measured=self.measured, user_op=user_op,
                          deterministic=self.rank_order)
            plan = None if algo.run is not None else self.plan(algo, call)
            if len(self._plans) >= 4096:
                self._plans.clear()
            hit = self._plans[key] = [algo, plan, False]
        teach = teaching and not hit[2]
        if teaching:
            hit[2] = True
        return hit[0], hit[1], teach

    def use_table(self, table) -> None:
        """Choose by ``table`` (tuning.Table) from now on, not as before it."""
        self.measured = table
        self._plans.clear()

    def run(self, algo, plan, call) -> None:
        """Run ``call`` with ``algo`` (its ``plan``, or its runner), then scale an average."""
        if plan is None:
            algo.run(self, call)
        else:
            self.run_plan(plan, call)
        if call.scale:
            _C.scale(call.out.ptr, call.out.numel, call.dtype.code, call.scale)

    def execute(self, call, algorithm: str | None = None) -> None:
        """Run ``call`` now, on this thread, without agreeing on it first: for algorithms
        built from others (hier), whose own call was agreed on."""
        algo, plan, _ = self.choose(call, algorithm)
        self.run(algo, plan, call)


def affinity() -> list[int]:
    """The cores this process may run on (whether ranks outnumber cores: no spinning)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
