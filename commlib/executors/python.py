"""The mpi4py executor: runs a schedule with non-blocking send/recv and the C++ kernels.

A schedule is first *compiled* into a plan (byte offsets, transfers cut into segments of
at most SEGMENT_BYTES), cached per (algorithm, collective, size, rank, count, itemsize,
params). Segments let the reduction of one piece overlap the arrival of the next; both
peers cut a transfer the same way because they derive it from the same element count.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from .. import _C
from ..errors import CommError, CommTimeoutError
from ..schedule import RecvReduce, Schedule
from ..work import Deadline, _abandon, wait_request

SEGMENT_BYTES = int(os.environ.get("COMMLIB_SEGMENT_BYTES", 1 << 20))
# Reductions land in a few scratch slots reused round-robin rather than one slot per
# segment: the scratch stays in cache and its size no longer grows with the message.
SCRATCH_SLOTS = int(os.environ.get("COMMLIB_SCRATCH_SLOTS", 4))
_TAG = 7
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class _Reduction:  # dst = src (op) scratch[scratch_offset:]
    dst: str
    dst_offset: int
    src: str
    src_offset: int
    count: int


@dataclass(frozen=True, slots=True)
class _Transfer:
    peer: int
    buf: str
    offset: int
    nbytes: int
    reduction: _Reduction | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    schedule: Schedule
    rounds: tuple  # (copies: ((src, src_off, dst, dst_off, nbytes), ...), recvs, sends)
    tmp_bytes: int
    slot_bytes: int  # one receive-scratch slot; SCRATCH_SLOTS of them follow tmp
    sent_bytes: int  # what this rank sends to peers in one run


def _segments(offset, count, itemsize):
    per = max(1, SEGMENT_BYTES // itemsize)
    for start in range(0, count, per):
        yield offset + start, min(per, count - start)


def compile_plan(schedule: Schedule, itemsize: int) -> Plan:
    tmp_bytes = -(-schedule.tmp_count * itemsize // _ALIGN) * _ALIGN
    rounds = []
    for rnd in schedule.rounds:
        copies = tuple((c.src.buf, c.src.offset * itemsize, c.dst.buf, c.dst.offset * itemsize,
                        c.src.count * itemsize) for c in rnd.copies)
        sends = tuple(_Transfer(s.peer, s.src.buf, off * itemsize, n * itemsize)
                      for s in rnd.sends for off, n in _segments(s.src.offset, s.src.count, itemsize))
        recvs = []
        for r in rnd.recvs:
            for off, n in _segments(r.dst.offset, r.dst.count, itemsize):
                if isinstance(r, RecvReduce):  # lands in a scratch slot chosen at run time
                    src_off = r.src.offset + off - r.dst.offset
                    red = _Reduction(r.dst.buf, off * itemsize, r.src.buf, src_off * itemsize, n)
                    recvs.append(_Transfer(r.peer, "arena", 0, n * itemsize, red))
                else:
                    recvs.append(_Transfer(r.peer, r.dst.buf, off * itemsize, n * itemsize))
        rounds.append((copies, tuple(recvs), sends))
    slot_bytes = min(SEGMENT_BYTES, schedule.scratch_count * itemsize)
    sent = sum(s.nbytes for _, _, sends in rounds for s in sends)
    return Plan(schedule, tuple(rounds), tmp_bytes, slot_bytes, sent)


@lru_cache(maxsize=4096)
def plan_for(algorithm, size: int, rank: int, count: int, itemsize: int, params: tuple) -> Plan:
    return compile_plan(algorithm.build(size, rank, count, itemsize, **dict(params)), itemsize)


class PythonExecutor:
    """Runs plans on one MPI communicator; one collective at a time (they share the arena)."""

    plan = staticmethod(plan_for)

    def __init__(self, mpi_comm: MPI.Comm):
        self.mpi = mpi_comm
        self._arena = np.empty(0, np.uint8)  # tmp, then receive scratch
        self._lock = threading.Lock()
        self.bytes_sent = 0  # to peers, over all runs
        self.timeout = 0.0  # seconds a run may wait for its peers (0: forever)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds

    def _arena_for(self, nbytes: int) -> np.ndarray:
        if self._arena.size < nbytes:
            self._arena = np.empty(nbytes, np.uint8)
        return self._arena

    def run(self, plan: Plan, bufs: dict, dtype_code: int, op_code: int) -> None:
        with self._lock:
            arena = self._arena_for(plan.tmp_bytes + SCRATCH_SLOTS * plan.slot_bytes)
            views = {name: b.bytes for name, b in bufs.items()}
            views["tmp"] = views["arena"] = arena
            ptrs = {name: b.ptr for name, b in bufs.items()}
            ptrs["tmp"] = ptrs["arena"] = arena.ctypes.data
            errors: list = []
            deadline = Deadline(self.timeout)
            for rnd in plan.rounds:
                self._run_round(rnd, plan, views, ptrs, dtype_code, op_code, errors, deadline)
            self.bytes_sent += plan.sent_bytes
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
        mpi, arena = self.mpi, views["arena"]
        slots = [plan.tmp_bytes + i * plan.slot_bytes for i in range(SCRATCH_SLOTS)]
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
                for other in [p[0] for p in pending] + sreqs:
                    _abandon(other, views)
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
                         keep=views)
