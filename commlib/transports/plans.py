"""Schedules (commlib/schedule.py) compiled for the executors that run them, one compiler
each: the shm transport's int64 plans (csrc/shm_plan.cpp reads them), the net transport's
(csrc/net.h), and the mpi transport's Python plans (transfers cut into segments, run by
transports/mpi.py). Each is cached per call shape; the ranks compile alike from the same
arguments, so their plans' transfers match.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..call import NONE, pack_name
from ..collectives import of as collective_of
from ..schedule import RecvReduce, Schedule

BUFFERS = {"out": 0, "in": 1, "tmp": 2}  # a schedule's buffers, as the C++ plans number them
ALIGN = 64  # the mpi plans' tmp, rounded up to it


# ---------------------------------------------------------------------------- mpi
@dataclass(frozen=True, slots=True)
class Reduction:  # dst = src (op) scratch[scratch_offset:]
    dst: str
    dst_offset: int
    src: str
    src_offset: int
    count: int


@dataclass(frozen=True, slots=True)
class Transfer:
    peer: int
    buf: str
    offset: int
    nbytes: int
    reduction: Reduction | None = None


@dataclass(frozen=True, slots=True)
class MpiPlan:
    schedule: Schedule
    rounds: tuple  # (copies: ((src, src_off, dst, dst_off, nbytes), ...), recvs, sends)
    tmp_bytes: int
    slot_bytes: int  # one receive-scratch slot; the transport's scratch_slots follow tmp
    sent_bytes: int  # what this rank sends to peers in one run


def _segments(offset, count, itemsize, segment_bytes):
    per = max(1, segment_bytes // itemsize)
    for start in range(0, count, per):
        yield offset + start, min(per, count - start)


def compile_mpi_plan(schedule: Schedule, itemsize: int, segment_bytes: int) -> MpiPlan:
    tmp_bytes = -(-schedule.tmp_count * itemsize // ALIGN) * ALIGN
    rounds = []
    for rnd in schedule.rounds:
        copies = tuple((c.src.buf, c.src.offset * itemsize, c.dst.buf, c.dst.offset * itemsize,
                        c.src.count * itemsize) for c in rnd.copies)
        sends = tuple(Transfer(s.peer, s.src.buf, off * itemsize, n * itemsize)
                      for s in rnd.sends
                      for off, n in _segments(s.src.offset, s.src.count, itemsize, segment_bytes))
        recvs = []
        for r in rnd.recvs:
            for off, n in _segments(r.dst.offset, r.dst.count, itemsize, segment_bytes):
                if isinstance(r, RecvReduce):  # lands in a scratch slot chosen at run time
                    src_off = r.src.offset + off - r.dst.offset
                    red = Reduction(r.dst.buf, off * itemsize, r.src.buf, src_off * itemsize, n)
                    recvs.append(Transfer(r.peer, "arena", 0, n * itemsize, red))
                else:
                    recvs.append(Transfer(r.peer, r.dst.buf, off * itemsize, n * itemsize))
        rounds.append((copies, tuple(recvs), sends))
    slot_bytes = min(segment_bytes, schedule.scratch_count * itemsize)
    sent = sum(s.nbytes for _, _, sends in rounds for s in sends)
    return MpiPlan(schedule, tuple(rounds), tmp_bytes, slot_bytes, sent)


@lru_cache(maxsize=4096)
def mpi_plan(algorithm, size: int, rank: int, count: int, itemsize: int, params: tuple,
             segment_bytes: int) -> MpiPlan:
    return compile_mpi_plan(algorithm.build(size, rank, count, itemsize, **dict(params)), itemsize,
                        segment_bytes)


# ---------------------------------------------------------------------------- net
@dataclass(frozen=True)
class NetPlan:
    steps: np.ndarray  # int64, the format csrc/net.h documents
    tmp_bytes: int


@lru_cache(maxsize=4096)
def net_plan(algorithm, size: int, rank: int, count: int, itemsize: int,
             params: tuple) -> NetPlan:
    schedule = algorithm.build(size, rank, count, itemsize, **dict(params))
    words = [len(schedule.rounds)]
    for rnd in schedule.rounds:
        words.append(len(rnd.copies))
        for c in rnd.copies:
            words += [BUFFERS[c.src.buf], c.src.offset * itemsize, BUFFERS[c.dst.buf],
                      c.dst.offset * itemsize, c.src.count * itemsize]
        words.append(len(rnd.sends))
        for s in rnd.sends:
            words += [s.peer, BUFFERS[s.src.buf], s.src.offset * itemsize, s.src.count * itemsize]
        words.append(len(rnd.recvs))
        for r in rnd.recvs:
            src = getattr(r, "src", None)
            words += [r.peer, BUFFERS[r.dst.buf], r.dst.offset * itemsize,
                      r.dst.count * itemsize, -1 if src is None else BUFFERS[src.buf],
                      0 if src is None else src.offset * itemsize]
    return NetPlan(np.array(words, np.int64), schedule.tmp_count * itemsize)


# ---------------------------------------------------------------------------- shm
@dataclass(frozen=True)
class ShmPlan:
    steps: np.ndarray  # int64, the format csrc/shm_plan.cpp documents
    tmp_bytes: int


def _deferrable(copy, rnd, user_aliased: bool) -> bool:
    """Whether ``copy`` may run at any time during its round: no transfer of the round
    reads or writes its destination, or writes its source. ``user_aliased``: "in" and "out"
    may be the same memory (in-place forms), so any use of one conflicts with the other."""
    def conflict(a, b):
        if user_aliased and {a.buf, b.buf} <= {"in", "out"} and a.buf != b.buf:
            return a.count > 0 and b.count > 0
        return a.overlaps(b)
    touched = [s.src for s in rnd.sends] + [r.dst for r in rnd.recvs] + [
        r.src for r in rnd.recvs if isinstance(r, RecvReduce)]
    written = [r.dst for r in rnd.recvs]
    return (not any(conflict(copy.dst, t) for t in touched)
            and not any(conflict(copy.src, w) for w in written))


def flatten(schedule: Schedule, itemsize: int, user_aliased: bool = True) -> np.ndarray:
    out = [len(schedule.rounds)]
    b = lambda r: BUFFERS[r.buf]  # noqa: E731
    for rnd in schedule.rounds:
        copies, sends, recvs = rnd.copies, rnd.sends, rnd.recvs
        out += [len(copies), len(sends), len(recvs)]
        for c in copies:
            out += [b(c.src), c.src.offset * itemsize, b(c.dst), c.dst.offset * itemsize,
                    c.src.count * itemsize, int(_deferrable(c, rnd, user_aliased))]
        for s in sends:
            out += [s.peer, b(s.src), s.src.offset * itemsize, s.src.count * itemsize]
        for r in recvs:
            reduce = isinstance(r, RecvReduce)
            src = r.src if reduce else r.dst
            out += [r.peer, b(r.dst), r.dst.offset * itemsize, b(src), src.offset * itemsize,
                    r.dst.count * itemsize, int(reduce)]
    return np.array(out, dtype=np.int64)


def call_header(algorithm, size: int, count: int, itemsize: int, params: dict) -> list:
    """The plan's head (csrc/shm_plan.cpp): the descriptor fields it fixes, then
    all_to_all's bytes to and from each peer, which every rank checks as a matrix."""
    kind = collective_of(algorithm.collective)
    head = [kind.code, pack_name(algorithm.name), NONE if kind.uneven else count,
            params.get("root", NONE), 0]
    if not kind.uneven:
        return head + [0]
    return head + [size] + [s * itemsize for s in params["input_splits"]] + [
        s * itemsize for s in params["output_splits"]]


@lru_cache(maxsize=4096)
def shm_plan(algorithm, size: int, rank: int, count: int, itemsize: int, params: tuple) -> ShmPlan:
    kwargs = dict(params)
    schedule = algorithm.build(size, rank, count, itemsize, **kwargs)
    # only a scatter or a gather accepts in-place forms where "in" is a block of "out"
    aliased = collective_of(algorithm.collective).parts in ("scatter", "gather")
    steps = flatten(schedule, itemsize, aliased)
    head = np.array(call_header(algorithm, size, count, itemsize, kwargs), np.int64)
    return ShmPlan(np.concatenate([head, steps]), schedule.tmp_count * itemsize)
