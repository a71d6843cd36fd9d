"""The interface every transport implements. Its *world* is how its ranks met (MpiWorld,
StoreWorld): ``allgather`` exchanges set-up facts as JSON, ``send``/``recv`` move
messages, ``split``/``dup`` make new worlds."""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _C, settings
from ..buffers import Buffer


@dataclass(frozen=True)
class Where:
    """What a cost depends on besides n and the bytes: the transport, its ranks per host,
    the sizes its data paths cut calls into (defaults: for costs away from a transport)."""
    transport: str = "mpi"
    local: Optional[int] = None
    cross: str = "mpi"  # what joins the hosts (hier's cross stage): net, mpi, or gloo
    staging_bytes: int = 1 << 20    # the shared-memory transport's staging (csrc/shm.h)
    slot_bytes: int = 16 << 20      # a CUDA IPC slot (commlib/transports/cuda_ipc.py)
    one_shot_bytes: int = 256 << 10  # CUDA IPC all_reduce chunks one-shot up to this size
    checked: bool = True  # calls agreed on before they run (COMMLIB_CHECK): gloo's cost

    @property
    def over_gloo(self) -> bool:
        """Whether gloo joins the ranks (torchrun's nodes): the whole group, or hier's hosts."""
        return "gloo" in (self.transport, self.cross)


class Transport(abc.ABC):
    """What one communicator's collectives run over. A subclass sets ``name`` (what costs
    see, with ``where``) and ``offers`` (the capabilities algorithm entries need), and
    implements the abstract methods below; one that offers "schedules" (mpi, shm, net)
    also ``plan(algo, call)``, algo's schedule compiled for its executor
    (transports/plans.py), and ``run_plan(plan, call)``, collective. Every wait is
    bounded by ``timeout``; a failed call fails alike on every rank. Runners call its
    own methods (direct, hier's stages, native's MPI communicator)."""

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
        # how its calls choose their algorithm (select.Choice), given by the dispatcher:
        # algorithms and their choice are the layers above this one
        self.choice = None
        self.memory = None  # host_memory.SharedHostMemory where the ranks share memory
        self._scratch: dict = {}
        # reducing calls take only algorithms that reduce in rank order (Algorithm.rank_order)
        self.deterministic = settings.get("COMMLIB_DETERMINISTIC")

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

    @staticmethod
    @abc.abstractmethod
    def suits(world) -> bool:
        """Whether auto picks this transport for ``world``'s ranks (transports.pick)."""

    @abc.abstractmethod
    def agree(self, desc, splits=None, itemsize: int = 1) -> None:
        """Return once every rank made the call ``desc`` (call.descriptor) describes, with
        all_to_all's ``splits`` (bytes to and from each peer); else every rank raises
        CollectiveMismatchError saying who called what. Collective."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it. Collective."""

    @property
    @abc.abstractmethod
    def bytes_sent(self) -> int:
        """Bytes this rank has sent to its peers so far, by every call."""

    @classmethod
    def create(cls, world) -> "Transport":
        """The transport for ``world`` (transports.pick's; a class may hand it to another)."""
        return cls(world)

    def agree_call(self, call, algo) -> None:
        """Agree on ``call`` before ``algo`` runs it, unless running it checks that itself
        or calls go unchecked (COMMLIB_CHECK=0, where a transport allows it)."""
        if self.checks_calls and not algo.agrees:
            self.agree(call.descriptor(algo.name), call.split_bytes(), call.dtype.itemsize)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds

    fast_kinds = frozenset()  # the entries its fast path runs (csrc/fast_path.h)
    plans_agree = False  # whether its fast path's plans agree on the call first (as net's)

    def fast_path(self, **kwargs):
        """A C++ fast path for this transport's calls (commlib/fast_path.py), or None."""
        return None

    def device_offers(self) -> frozenset:
        """What calls on GPU arrays may use here beyond ``offers`` (a CUDA-aware MPI)."""
        return frozenset()

    def close(self) -> None:
        self.world.close()

    def interrupt(self) -> None:
        """From any thread: a call in flight on this rank fails now, and any later one
        (Communicator.abort). Where a transport cannot (MPI's, gloo's), it ends at its
        timeout or at its peer's death."""
        for part in self.parts():
            part.interrupt()

    def parts(self) -> tuple:
        """The transports this one runs some calls' stages on (hier's): each chooses for
        its own calls."""
        return ()

    def use_table(self, table) -> None:
        """Take what a measured table (table.Table, or None) says of how this transport
        moves data (the shm transport: how it reads in place)."""

    def run(self, algo, plan, call) -> None:
        """Run ``call`` with ``algo`` (its ``plan``, or its runner), then scale an average."""
        if plan is None:
            algo.run(self, call)
        else:
            self.run_plan(plan, call)
        if call.scale:
            _C.scale(call.out.ptr, call.out.numel, call.dtype.code, call.scale)

    def submits(self, algo, call) -> bool:
        """Whether ``call`` run by ``algo`` runs here as a job of a thread of the
        transport's own (submit), beside whatever the caller does."""
        return False

    def submit(self, call, algo, plan, seconds: float, now: bool = False):
        """Hand ``call`` (agreement, ``algo``'s run, scaling) to the transport's own thread,
        bounded by ``seconds`` (``now``: on this one, when waited for); returns the job:
        ``wait()`` sleeps until it is done, raises its error, and returns when it ran
        (started, finished: time.monotonic's clock), ``done()`` says whether it is,
        ``settle(timeout)`` sleeps until it is (without taking its result); it holds
        ``call``'s buffers."""
        raise NotImplementedError(f"the {self.name} transport runs no jobs")

    def execute(self, call, algorithm: str | None = None) -> None:
        """Run ``call`` now, on this thread, without agreeing on it first: for algorithms
        built from others (hier), whose own call was agreed on."""
        algo, plan, _ = self.choice(call, algorithm)
        self.run(algo, plan, call)


def affinity() -> list[int]:
    """The cores this process may run on (whether ranks outnumber cores: no spinning)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
