"""shm: the ranks of one host, over shared memory (csrc/shm.h). Schedules run flattened
into the int64 plans csrc/shm_plan.cpp reads, the direct collectives in C++
(csrc/shm_direct.cpp); both publish every call's descriptor with it, so the ranks agree on
each call without a message of its own. MPI's own collectives run beside them where the
world is MPI's, and meet here first. Calls on numpy arrays take the C++ fast path
(commlib/fast_path.py) unless COMMLIB_FAST_PATH=0. One-copy collectives
(csrc/shm_one_copy.cpp) are offered where every rank can read and write its peers' memory
with process_vm_readv and process_vm_writev (probed at set-up; COMMLIB_ONE_COPY=0 turns
them off).
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import _C, settings
from ..call import NONE
from ..collectives import ROOTED
from ..errors import CommError
from ..host_memory import SharedHostMemory
from .base import Transport, Where
from .plans import shm_plan



class ShmTransport(Transport):
    name = "shm"
    fast_kinds = frozenset({"plan", "direct", "one_copy"})

    def __init__(self, world):
        super().__init__(world)
        # (the fewest cores any rank has: every rank sees the same)
        self.cores_each = min(world.allgather(world.cores_each()))
        self.shm = _set_up(world, self.cores_each)  # the C++ ShmComm
        self.timeout = self.shm.timeout
        self.memory = SharedHostMemory(self.shm, world)  # Communicator.empty's
        one_copy = _probe_one_copy(world, self.shm)
        self.offers = frozenset({"shm", "schedules", *one_copy, *world.offers})
        self.where = Where(self.name, staging_bytes=self.shm.staging_bytes)

    @staticmethod
    def suits(world) -> bool:
        return world.hosts[0] == 1

    def agree(self, desc, splits=None, itemsize=1) -> None:
        self.shm.agree(desc, *(splits or ([], [])), itemsize)

    def agree_call(self, call, algo) -> None:
        """Direct ops check every peer's call, and plans the peers they meet, so that a
        disagreement reaches every rank whose result depends on all the others. In a
        rooted plan (tree or ring broadcast and reduce) some ranks' parts end without
        that: they agree first, as runners do."""
        if (not algo.agrees and algo.build is None) or (
                algo.build is not None and call.collective in ROOTED):
            super().agree_call(call, algo)

    def barrier(self) -> None:
        self.shm.barrier()

    def plan(self, algo, call):
        return shm_plan(algo, self.size, self.rank, call.count, call.dtype.itemsize,
                        call.params)

    def run_plan(self, plan, call) -> None:
        inp = call.inp.ptr if call.inp is not None else 0
        self.shm.run_plan(plan.steps, call.out.ptr, inp, plan.tmp_bytes, call.dtype.code,
                          call.op_code)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = self.shm.timeout = seconds

    @property
    def base_pages_in_place(self) -> frozenset:
        """The collectives whose one_copy (and direct's all_to_all) read buffers on base
        pages in place too, else stage them (csrc/shm_one_copy.cpp): as this layout's
        table measured."""
        mask = self.shm.base_pages_in_place
        return frozenset(c for c, code in _C.COLLECTIVES.items() if mask >> code & 1)

    @base_pages_in_place.setter
    def base_pages_in_place(self, collectives) -> None:
        if self.shm is not None:  # (None: closed)
            self.shm.base_pages_in_place = sum(1 << _C.COLLECTIVES[c] for c in set(collectives))

    @property
    def parts_in_place_from(self) -> int:
        """The bytes of a rank's largest part from which direct's all_to_all reads its
        parts in place, where cheap to read (-1: where they take several staging pieces):
        as this layout's table measured."""
        return self.shm.parts_in_place_from

    @parts_in_place_from.setter
    def parts_in_place_from(self, nbytes) -> None:
        if self.shm is not None:
            self.shm.parts_in_place_from = int(nbytes)

    def use_table(self, table) -> None:
        self.base_pages_in_place = () if table is None else table.base_pages_in_place
        self.parts_in_place_from = -1 if table is None else table.parts_in_place_from

    def direct(self, call) -> None:
        """The call's direct collective (csrc/shm_direct.cpp)."""
        self.shm.direct(*_arguments(call))

    def one_copy(self, call, otherwise=None, only_regions: bool = False) -> None:
        """The call's one-copy collective (csrc/shm_one_copy.cpp); where it stages, by the
        plan ``otherwise`` (a schedule's) if given, else as direct does; ``only_regions``:
        it reads in place only buffers in regions (Communicator.empty's)."""
        steps, tmp = (otherwise.steps, otherwise.tmp_bytes) if otherwise is not None else \
            (_NO_STEPS, 0)
        self.shm.one_copy(*_arguments(call), steps, tmp, only_regions)

    def all_reduce_phase(self, call, phase: int) -> None:
        """An all_reduce's reduce-scatter (1) or all-gather (2) alone (hier's host stages).
        Direct's meet twice per staging piece (2 per 256 KiB at 2 ranks), each meeting a
        wait for a peer's thread to get a core; where the host's ranks outnumber its cores
        each costs a scheduler's turn, and beside compute a long one (2 hosts of 1 core x
        2 ranks, an async 16 MiB beside a matmul: phase 1 took 50-125 ms, alone 10). There,
        where one_copy can run, the phases read the peers' buffers in place: three
        meetings in all (1-20 ms beside the matmul; blocking calls as fast either way).
        ``cores_each`` is agreed: every host-mate runs the same phases."""
        args = call.out.ptr, call.out.numel, call.dtype.code, call.op_code, phase
        if "one_copy" in self.offers and self.cores_each < 1:
            self.shm.all_reduce_phase_in_place(*args)
        else:
            self.shm.all_reduce(*args)

    def fast_path(self, **kwargs):
        if not settings.get("COMMLIB_FAST_PATH"):
            return None
        return _C.FastPath(self.shm, **kwargs)

    def device_offers(self) -> frozenset:
        from . import load
        ipc = {"cuda_ipc"} if load("cuda_ipc").suits(self) else set()
        return frozenset(ipc | ({"cuda_mpi"} if self.world.takes_device_memory else set()))

    @property
    def bytes_sent(self) -> int:
        return self.shm.bytes_sent + self.world.bytes_sent

    def interrupt(self) -> None:
        if self.shm is not None:
            self.shm.abort()

    def close(self) -> None:
        super().close()
        self.memory.close()
        self.shm = None  # unmaps the segments


def _set_up(group, cores_each: float):
    """The ranks' ShmComm, collectively: each creates its segment, the names travel through
    ``group``, every rank maps every segment, then each unlinks its own, so that nothing
    is left in /dev/shm whatever happens next (``cores_each``: the cores per process)."""
    rank, size = group.rank, group.size
    config = group.allgather(_config_from_env())[0]  # rank 0's: every rank must agree
    # Spinning on a core that a peer needs only delays it: no spinning when ranks
    # outnumber cores. Nor, where each has one core, in an async call's background
    # thread: the main thread's compute needs that core (DDP at 2 ranks on 2 cores:
    # steps 7-9% shorter; blocking calls on the main thread spin as before). Nor yielding
    # there: each yield beside the compute gives it a whole time slice; it sleeps at once.
    spin = 0 if cores_each < 1 else settings.get("COMMLIB_SHM_SPIN")
    shm, error = None, None
    try:
        shm = _C.ShmComm(rank, size, spin=spin, yields=200,
                         background_spin=spin if cores_each >= 2 else 0,
                         background_yields=200 if cores_each >= 2 else 0, **config)
    except (RuntimeError, ValueError) as e:
        error = e
    try:
        names = group.allgather(shm.name if shm else None)
    except CommError:  # a peer died meanwhile (a store world sees it): leave nothing
        if shm:
            shm.unlink_own()
        raise
    if shm and None not in names:
        try:
            shm.attach(names)
        except RuntimeError as e:
            error = e
    # every rank has mapped every segment (or given up): unlink, so a crash leaves nothing
    failed = any(group.allgather(error is not None))
    if shm:
        shm.unlink_own()
    if failed:
        raise CommError(f"shared-memory set-up failed: {error or 'on another rank'}; "
                        "set COMMLIB_TRANSPORT=mpi to run without it")
    return shm


_NO_STEPS = np.zeros(0, np.int64)


def _arguments(call) -> tuple:
    """``call`` as ShmComm.direct and ShmComm.one_copy take it."""
    return (_C.COLLECTIVES[call.collective], call.out.ptr,
            call.inp.ptr if call.inp is not None else 0, call.count, call.dtype.code,
            call.op_code, NONE if call.root is None else call.root, *(call.splits or ((), ())))


def _probe_one_copy(group, shm) -> set:
    """{"one_copy"} where every rank can read and write its peers' memory (process_vm_readv
    and process_vm_writev), else an empty set, and rank 0 warns why (collective over
    ``group``)."""
    if not settings.get("COMMLIB_ONE_COPY"):
        return set()
    why = [w for w in group.allgather(shm.probe_one_copy()) if w]
    if why and group.rank == 0:
        warnings.warn(f"commlib: one-copy collectives are off, staged ones run instead: "
                      f"{why[0]}", RuntimeWarning, stacklevel=2)
    return set() if why else {"one_copy"}


def _config_from_env() -> dict:
    return {name: settings.get(f"COMMLIB_SHM_{name.upper()}")
            for name in ("slot_bytes", "slots", "staging_bytes")}



