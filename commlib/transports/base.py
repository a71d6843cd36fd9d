"""The interface every transport implements (see commlib/transports/__init__.py).

Vocabulary:
  world      how a communicator's ranks found each other and exchange set-up facts and
             point-to-point messages: an MpiWorld (mpiexec) or a StoreWorld (torchrun).
             ``world.group.allgather(value)`` exchanges JSON; ``world.send``/``recv`` move
             messages; ``world.split``/``dup`` make the worlds of new communicators.
  plan       a schedule compiled for the transport's executor, cached per call shape.
  agree      every rank made the same call (its descriptor, commlib/call.py), or all raise
             CollectiveMismatchError naming what differs.
"""
from __future__ import annotations

import os

from .. import _C
from ..algorithms import Where
from ..select import algorithm_overrides, choose


class Transport:
    """What one communicator's collectives run over. Subclasses set ``name`` (what costs
    see: Where.transport) and ``offers`` (the capabilities algorithm entries need), and
    implement the abstract methods."""

    name: str
    offers: frozenset

    def __init__(self, world):
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.timeout = 0.0  # seconds a call may wait for its peers (0: forever)
        self.where = Where(self.name)  # what its algorithms' costs depend on
        self._overrides = algorithm_overrides()
        self._plans: dict = {}

    # ------------------------------------------------------------------ what it must do
    def agree(self, desc: list, splits=None, itemsize: int = 1) -> None:
        """Raise CollectiveMismatchError on every rank unless all made the call ``desc``
        describes (with these all_to_all ``splits``, bytes to and from each peer)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def plan(self, algo, call):
        """``algo``'s schedule for ``call`` compiled for this transport's executor."""
        raise NotImplementedError

    def run_plan(self, plan, call) -> None:
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to its peers (see Communicator.bytes_sent)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what it may refine
    @property
    def checks_calls(self) -> bool:
        """Whether calls are checked for agreement at all (a rank whose arguments are
        invalid then tells its peers)."""
        return True

    def agree_call(self, call, algo) -> None:
        """Agree on ``call`` before ``algo`` runs it, unless running it checks that itself."""
        self.agree(call.descriptor(algo.name), call.split_bytes(), call.dtype.itemsize)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds

    def fast_path(self, **kwargs):
        """A C++ fast path for this transport's calls (commlib/fast_path.py), or None."""
        return None

    def device_offers(self) -> frozenset:
        """What calls on GPU arrays may use here beyond ``offers`` (a CUDA-aware MPI)."""
        return frozenset()

    def close(self) -> None:
        self.world.close()

    # ------------------------------------------------------------------ shared by all
    def choose(self, call, requested: str | None):
        """(algorithm, plan or None for runners, whether this is the first such call) for
        ``call`` with ``requested`` (None: COMMLIB_ALGO_<COLLECTIVE>, else auto), cached
        per call shape."""
        key = (call.collective, requested, call.count, call.dtype.itemsize, call.params)
        hit = self._plans.get(key)
        if hit is not None:
            return hit[0], hit[1], False
        algo = choose(call.collective, requested or self._overrides.get(call.collective, "auto"),
                      self.size, call.nbytes, where=self.where, offers=self.offers)
        plan = None if algo.run is not None else self.plan(algo, call)
        if len(self._plans) >= 4096:
            self._plans.clear()
        self._plans[key] = (algo, plan)
        return algo, plan, True

    def run(self, algo, plan, call) -> None:
        """Run ``call`` with ``algo`` (its ``plan``, or its runner) now, then scale an
        average."""
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
