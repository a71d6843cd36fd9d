"""mpi: every rank through MPI (mpi4py). Schedules are compiled into plans (plans.py: byte
offsets, transfers cut into segments of at most COMMLIB_SEGMENT_BYTES) and run with
non-blocking send/recv and the C++ kernels: the reduction of one segment overlaps the
arrival of the next (both peers cut a transfer alike: from the same element count).
MPI's own collectives (native) run on the same private communicator. Unless
COMMLIB_CHECK=0, the ranks agree on every call before it moves data (Agreement).
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque
from functools import lru_cache, partial

import numpy as np
from mpi4py import MPI

from .. import _C, settings
from ..call import NONE, descriptor
from ..errors import CommError, CommTimeoutError
from ..work import Deadline, _abandon, wait_request
from . import rows
from .base import Transport
from .mpi_types import c_tables
from .mpi_world import MpiWorld
from .plans import mpi_plan

AGREEMENT_TAG = 6  # on the collective communicator; plans use 7
_TAG = 7  # plans' transfers


class Agreement:
    """Every rank sends its call's descriptor (and all_to_all's splits) to every other:
    point to point, so that a timeout names the ranks that never arrived, over one table
    and one set of persistent requests (calls run one at a time; starting those is cheap).
    A row (transports/rows.py) may carry a payload after its header (the eager
    algorithm's data ride with the descriptor). The requests are mpi4py's; starting,
    waiting and checking are C++ (csrc/mpi_exchange.cpp, ``native``), where the fast path
    runs eager calls too."""

    def __init__(self, mpi_comm):
        size, me = mpi_comm.Get_size(), mpi_comm.Get_rank()
        # receives take a whole row, so no message is ever truncated
        self.header = rows.header_words(size)
        self.inbox = np.zeros((size, self.header + rows.mpi_payload_bytes(size) // 8),
                              np.int64)
        self.peer_ranks = [p for p in range(size) if p != me]
        self.receives = [mpi_comm.Recv_init(self.inbox[p], p, AGREEMENT_TAG)
                         for p in self.peer_ranks]
        self.native = _C.MpiExchange(
            _mpi_entry_points(), MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status), self.inbox,
            self.header, me, self.peer_ranks, [MPI._handleof(r) for r in self.receives],
            partial(_persistent_sends, mpi_comm, self.inbox[me], self.peer_ranks))
        use_native(self.native, mpi_comm)

    def check(self, desc: list, itemsize: int, splits=None) -> None:
        self.native.check(desc, itemsize, [*splits[0], *splits[1]] if splits else [])

    def free(self) -> None:
        for request in self.receives + list(self.native.sends):
            if request and not request.Test():  # abandoned after a timeout: MPI keeps it
                _abandon(request, self.inbox, cancel=False)
                continue
            request.Free()


def use_native(exchange, mpi_comm) -> None:
    """The fast path's native entries on ``exchange`` (the C++ side of an agreement): MPI's
    own collectives on ``mpi_comm``, where every handle MPI takes by value is as wide as a
    request (MPICH's and Open MPI's)."""
    if {MPI._sizeof(t) for t in (MPI.Datatype, MPI.Op, MPI.Comm)} == {MPI._sizeof(MPI.Request)}:
        exchange.use_native(_mpi_entry_points(), MPI._sizeof(MPI.Status),
                            MPI._handleof(mpi_comm), *c_tables(),
                            int(MPI.IN_PLACE) % (1 << 64), MPI._sizeof(MPI.Request))


def _persistent_sends(comm, row: np.ndarray, peers: list, words: int) -> tuple[list, list]:
    """Persistent sends of ``row[:words]`` to each of ``peers``, and their handles."""
    sends = [comm.Send_init(row[:words], p, AGREEMENT_TAG) for p in peers]
    return sends, [MPI._handleof(r) for r in sends]


@lru_cache(maxsize=None)
def _mpi_entry_points() -> dict:
    """The addresses of the MPI functions csrc/mpi_exchange.cpp calls, in the MPI library
    mpi4py loaded (found through its module, which links it)."""
    library = ctypes.CDLL(MPI.__file__)
    return {name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            for name in ("MPI_Startall", "MPI_Testall", "MPI_Test", "MPI_Cancel",
                         "MPI_Error_string", "MPI_Iallreduce", "MPI_Ireduce",
                         "MPI_Ireduce_scatter_block", "MPI_Iallgather", "MPI_Ialltoallv",
                         "MPI_Ibcast")}


class MpiTransport(Transport):
    name = "mpi"
    offers = frozenset({"mpi", "schedules", "eager"})

    def __init__(self, world: MpiWorld):
        super().__init__(world)
        self.checks_calls = settings.get("COMMLIB_CHECK")
        # (native entries agree first, as the general path does where calls are checked)
        self.fast_kinds = frozenset({"eager", "native"} if self.checks_calls else {"eager"})
        self.agreement = self.make_agreement(world)  # (eager's exchange, even unchecked)
        self._arena = np.empty(0, np.uint8)  # a plan's tmp, then its receive scratch
        self._lock = threading.Lock()  # one plan at a time (they share the arena)
        self._sent = 0  # by plans, to peers
        self.segment_bytes = settings.get("COMMLIB_SEGMENT_BYTES")
        # Reductions land in a few scratch slots reused round-robin rather than one slot
        # per segment: the scratch stays in cache and its size does not grow with the message.
        self.scratch_slots = settings.get("COMMLIB_SCRATCH_SLOTS")

    @staticmethod
    def suits(world) -> bool:
        return True

    def make_agreement(self, world):
        """What checks this transport's calls, and carries eager's data: over MPI."""
        return Agreement(world.coll)

    def set_timeout(self, seconds: float) -> None:
        super().set_timeout(seconds)
        self.agreement.native.timeout = seconds

    def agree(self, desc, splits=None, itemsize=1) -> None:
        self.agreement.check(desc, itemsize, splits)

    def eager(self, call) -> None:
        """An eager collective (algorithms/eager.py), run by the agreement's exchange."""
        inp = call.out if call.inp is None else call.inp
        self.agreement.native.eager(call.descriptor("eager"), call.out.ptr, call.out.numel,
                                    inp.ptr, inp.numel, call.op_code)

    def fast_path(self, **kwargs):
        if not settings.get("COMMLIB_FAST_PATH"):
            return None
        return _C.FastPath(self.agreement.native, **kwargs)

    def barrier(self) -> None:
        if self.checks_calls:  # the agreement's exchange is a barrier too
            self.agree(descriptor("barrier", "native", 0, NONE, NONE, NONE))
        else:
            wait_request(self.world.coll.Ibarrier(), Deadline(self.timeout),
                         "its peers to arrive")

    def plan(self, algo, call):
        return mpi_plan(algo, self.size, self.rank, call.count, call.dtype.itemsize,
                        call.params, self.segment_bytes)

    def run_plan(self, plan, call) -> None:
        with self._lock:
            needed = plan.tmp_bytes + self.scratch_slots * plan.slot_bytes
            if self._arena.size < needed:
                self._arena = np.empty(needed, np.uint8)
            arena = self._arena
            views = {name: b.bytes for name, b in call.bufs.items()}
            views["tmp"] = views["arena"] = arena
            ptrs = {name: b.ptr for name, b in call.bufs.items()}
            ptrs["tmp"] = ptrs["arena"] = arena.ctypes.data
            errors: list = []
            deadline = Deadline(self.timeout)
            for rnd in plan.rounds:
                self._run_round(rnd, plan, views, ptrs, call.dtype.code, call.op_code, errors,
                                deadline)
            self._sent += plan.sent_bytes
            if errors:
                raise errors[0]

    def _run_round(self, rnd, plan, views, ptrs, dtype_code, op_code, errors, deadline):
        """One round. Receives are posted in schedule order (MPI matches in posting order);
        one needing a scratch slot waits for a free one, freed as earlier ones are reduced.
        A bad transfer is recorded, not raised at once: finishing the schedule keeps every
        peer's transfers matched, so one disagreement cannot hang the others."""
        copies, recvs, sends = rnd
        for src, src_off, dst, dst_off, n in copies:
            _C.copy(ptrs[dst] + dst_off, ptrs[src] + src_off, n)
        mpi, arena = self.world.coll, views["arena"]
        slots = [plan.tmp_bytes + i * plan.slot_bytes for i in range(self.scratch_slots)]
        pending, posted = deque(), 0

        def post():
            nonlocal posted
            while posted < len(recvs):
                t = recvs[posted]
                if t.reduction is None:
                    slot, view = None, views[t.buf][t.offset:t.offset + t.nbytes]
                elif slots:
                    slot = slots.pop()
                    view = arena[slot:slot + t.nbytes]
                else:
                    return
                pending.append((mpi.Irecv(view, t.peer, _TAG), t, slot))
                posted += 1

        post()
        sreqs = [mpi.Isend(views[t.buf][t.offset:t.offset + t.nbytes], t.peer, _TAG) for t in sends]
        status = MPI.Status()
        while pending:
            req, t, slot = pending.popleft()
            try:
                wait_request(req, deadline, f"rank {t.peer} (a {t.nbytes}-byte receive)",
                             status, views)
            except CommTimeoutError:  # the peers' state is unknown: drop everything posted
                for other, _, _ in pending:
                    _abandon(other, views)
                for other in sreqs:
                    _abandon(other, views, cancel=False)
                raise
            except MPI.Exception as e:  # e.g. a message longer than expected (truncated)
                errors.append(CommError(f"receive from rank {t.peer} failed: {e}"))
            else:
                got = status.Get_count(MPI.BYTE)
                red = t.reduction
                if got != t.nbytes:
                    errors.append(CommError(
                        f"received {got} bytes from rank {t.peer}, expected {t.nbytes}: the "
                        "ranks disagree on counts or splits"))
                elif red is not None:
                    _C.reduce(ptrs[red.dst] + red.dst_offset, ptrs[red.src] + red.src_offset,
                              ptrs["arena"] + slot, red.count, dtype_code, op_code)
            if slot is not None:
                slots.append(slot)
                post()
        for req, t in zip(sreqs, sends):
            wait_request(req, deadline, f"rank {t.peer} to take a {t.nbytes}-byte send",
                         keep=views, cancel=False)

    def device_offers(self) -> frozenset:
        return frozenset({"cuda_mpi"}) if self.world.takes_device_memory else frozenset()

    @property
    def bytes_sent(self) -> int:
        return self._sent + self.agreement.native.bytes_sent + self.world.bytes_sent

    def close(self) -> None:
        self.agreement.free()
        super().close()
