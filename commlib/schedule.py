"""Schedules: the intermediate form every algorithm produces, and a simulator that checks them.

Vocabulary
    buffer  one array of a collective, named "in", "out" or "tmp" (element-indexed)
    region  a contiguous slice of a buffer: (buffer, offset, count) in elements
    step    Send(peer, src) | Recv(peer, dst) | RecvReduce(peer, dst, src) | Copy(src, dst);
            RecvReduce stores ``src (op) incoming`` into dst (dst may be src itself)
    round   steps posted together: copies run first, in order, then every transfer is
            posted; the round ends when all of them completed
    schedule one rank's ordered rounds, plus how many "tmp" elements it needs

Transfers between a pair of ranks match in posting order (MPI's non-overtaking rule), so
the k-th send from A to B pairs with the k-th receive on B from A.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np


class ScheduleError(Exception):
    """A schedule that deadlocks, mismatches its peer, or races within a round."""


@dataclass(frozen=True, slots=True)
class Region:
    buf: str
    offset: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + self.count

    def overlaps(self, other: "Region") -> bool:
        return (self.buf == other.buf and self.count > 0 and other.count > 0
                and self.offset < other.end and other.offset < self.end)


@dataclass(frozen=True, slots=True)
class Send:
    peer: int
    src: Region


@dataclass(frozen=True, slots=True)
class Recv:
    peer: int
    dst: Region


@dataclass(frozen=True, slots=True)
class RecvReduce:
    peer: int
    dst: Region
    src: Region


@dataclass(frozen=True, slots=True)
class Copy:
    src: Region
    dst: Region


Step = Union[Send, Recv, RecvReduce, Copy]


@dataclass(frozen=True, slots=True)
class Round:
    steps: tuple

    @property
    def copies(self):
        return [s for s in self.steps if isinstance(s, Copy)]

    @property
    def sends(self):
        return [s for s in self.steps if isinstance(s, Send)]

    @property
    def recvs(self):
        return [s for s in self.steps if isinstance(s, (Recv, RecvReduce))]


@dataclass(frozen=True, slots=True)
class Schedule:
    rounds: tuple
    tmp_count: int = 0

    @property
    def scratch_count(self) -> int:
        """Elements of receive scratch a round needs at most (RecvReduce lands there first)."""
        return max((sum(s.dst.count for s in r.steps if isinstance(s, RecvReduce))
                    for r in self.rounds), default=0)


def _count(step: Step) -> int:
    return step.src.count if isinstance(step, (Send, Copy)) else step.dst.count


class Builder:
    """Collects rounds; steps that move nothing are dropped on every rank alike, so peers agree."""

    def __init__(self):
        self._rounds: list[Round] = []

    def round(self, *steps: Step) -> None:
        kept = tuple(s for s in steps if _count(s) > 0
                     and not (isinstance(s, Copy) and s.src == s.dst))
        if kept:
            self._rounds.append(Round(kept))

    def build(self, tmp_count: int = 0) -> Schedule:
        return Schedule(tuple(self._rounds), tmp_count)


def chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` elements as ``parts`` contiguous (offset, count), sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((off, n))
        off += n
    return out


# ---------------------------------------------------------------------------------------
# Simulator: every rank's schedule in one process, no MPI.

_NUMPY_OPS: dict[str, Callable] = {"sum": np.add, "prod": np.multiply,
                                   "min": np.minimum, "max": np.maximum,
                                   "band": np.bitwise_and, "bor": np.bitwise_or,
                                   "bxor": np.bitwise_xor}


def _check_round(rank: int, index: int, rnd: Round, buffers: dict) -> None:
    for step in rnd.steps:
        for region in (getattr(step, "src", None), getattr(step, "dst", None)):
            if region is not None:
                size = len(buffers[region.buf])
                if region.offset < 0 or region.end > size:
                    raise ScheduleError(f"rank {rank} round {index}: {region} outside "
                                        f"buffer {region.buf!r} of {size} elements")
        if hasattr(step, "peer") and step.peer == rank:
            raise ScheduleError(f"rank {rank} round {index}: transfer to itself {step}")
    transfers = rnd.sends + rnd.recvs
    for i, a in enumerate(transfers):
        if isinstance(a, Send):
            continue
        for j, b in enumerate(transfers):
            reads = [b.src] if isinstance(b, (Send, RecvReduce)) and i != j else []
            writes = [b.dst] if isinstance(b, (Recv, RecvReduce)) and i != j else []
            if any(a.dst.overlaps(r) for r in reads + writes):
                raise ScheduleError(f"rank {rank} round {index}: {a} races with {b}")


def simulate(schedules: Sequence[Schedule], buffers: Sequence[dict], op: str = "sum") -> None:
    """Run all ranks' schedules on ``buffers`` (one dict of numpy arrays per rank), in place.

    Raises ScheduleError on deadlock, a transfer without partner, mismatched counts, or a
    round whose transfers race on the same elements.
    """
    reduce = _NUMPY_OPS[op]
    n = len(schedules)
    position = [0] * n
    for r, sched in enumerate(schedules):
        bufs = buffers[r]
        if sched.tmp_count:
            bufs["tmp"] = np.full(sched.tmp_count, np.nan)
        for i, rnd in enumerate(sched.rounds):
            _check_round(r, i, rnd, bufs)

    # number each transfer per (src, dst) pair in posting order
    def numbered(r):
        seen, out = {}, []
        for i, rnd in enumerate(schedules[r].rounds):
            for s in rnd.sends + rnd.recvs:
                key = (r, s.peer) if isinstance(s, Send) else (s.peer, r)
                k = seen.get(key, 0)
                seen[key] = k + 1
                out.append((i, key, k, s))
        return out

    pending: list[dict] = []  # per rank: (pair, k, is_send) -> step, for the current round
    all_steps = [numbered(r) for r in range(n)]

    def enter(r):
        while position[r] < len(schedules[r].rounds):
            rnd = schedules[r].rounds[position[r]]
            for c in rnd.copies:
                view = buffers[r][c.src.buf][c.src.offset:c.src.end].copy()
                buffers[r][c.dst.buf][c.dst.offset:c.dst.end] = view
            pending[r] = {(key, k, isinstance(s, Send)): s
                          for i, key, k, s in all_steps[r] if i == position[r]}
            if pending[r]:
                return
            position[r] += 1

    pending = [dict() for _ in range(n)]
    for r in range(n):
        enter(r)
    while any(position[r] < len(schedules[r].rounds) for r in range(n)):
        progressed = False
        for a in range(n):
            for (pair, k, is_send), send in list(pending[a].items()):
                if not is_send:
                    continue
                b = pair[1]
                recv = pending[b].get((pair, k, False))
                if recv is None:
                    continue
                if send.src.count != recv.dst.count:
                    raise ScheduleError(f"rank {a} sends {send.src.count} elements to rank {b} "
                                        f"which expects {recv.dst.count} ({send} vs {recv})")
                data = buffers[a][send.src.buf][send.src.offset:send.src.end].copy()
                dst = buffers[b][recv.dst.buf]
                if isinstance(recv, RecvReduce):
                    src = buffers[b][recv.src.buf][recv.src.offset:recv.src.end]
                    data = reduce(src, data)
                dst[recv.dst.offset:recv.dst.end] = data
                del pending[a][(pair, k, True)], pending[b][(pair, k, False)]
                progressed = True
        for r in range(n):
            if position[r] < len(schedules[r].rounds) and not pending[r]:
                position[r] += 1
                enter(r)
                progressed = True
        if not progressed:
            stuck = {r: sorted(str(s) for s in pending[r].values())
                     for r in range(n) if pending[r]}
            raise ScheduleError(f"deadlock: ranks wait forever on {stuck}")
