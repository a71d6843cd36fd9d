"""The shared-memory executor: schedules and direct collectives over csrc/shm.cpp.

Set-up is collective over the (single-host) communicator: each rank creates its segment,
the names travel over MPI (or a store: commlib/transports/store.py), every rank maps every segment,
and once all have (a barrier) each unlinks its own, so nothing is left in /dev/shm
whatever happens next.

A schedule is flattened once into the int64 plan csrc/shm_plan.cpp reads (cached like the
mpi4py executor's plans), headed by what the ranks must agree on about the call (its
descriptor, commlib/call.py), so that ranks that disagree fail with
CollectiveMismatchError instead of exchanging wrong data.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from .. import _C
from ..call import NONE, pack_name
from ..errors import CommError
from ..schedule import RecvReduce, Schedule

_BUFFERS = {"out": 0, "in": 1, "tmp": 2}


def _config_from_env() -> dict:
    def get(name, default):
        value = os.environ.get(f"COMMLIB_SHM_{name.upper()}", default)
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"COMMLIB_SHM_{name.upper()}={value!r}; expected an int") from None
    return {"slot_bytes": get("slot_bytes", 64 << 10), "slots": get("slots", 8),
            "staging_bytes": get("staging_bytes", 1 << 20)}


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
    b = lambda r: _BUFFERS[r.buf]  # noqa: E731
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
    collective = algorithm.collective
    head = [_C.COLLECTIVES[collective], pack_name(algorithm.name),
            NONE if collective == "all_to_all" else count, params.get("root", NONE), 0]
    if collective != "all_to_all":
        return head + [0]
    return head + [size] + [s * itemsize for s in params["input_splits"]] + [
        s * itemsize for s in params["output_splits"]]


@lru_cache(maxsize=4096)
def plan_for(algorithm, size: int, rank: int, count: int, itemsize: int, params: tuple) -> ShmPlan:
    kwargs = dict(params)
    schedule = algorithm.build(size, rank, count, itemsize, **kwargs)
    # only reduce_scatter and all_gather accept in-place forms where "in" is part of "out"
    aliased = algorithm.collective in ("reduce_scatter", "all_gather")
    steps = flatten(schedule, itemsize, aliased)
    head = np.array(call_header(algorithm, size, count, itemsize, kwargs), np.int64)
    return ShmPlan(np.concatenate([head, steps]), schedule.tmp_count * itemsize)


class ShmExecutor:
    """Runs schedules and direct collectives among the ranks of one host."""

    def __init__(self, group, crowded: bool):
        """``group``: the communicator's ranks, through anything with ``rank``, ``size`` and
        ``allgather(value)`` (an mpi4py communicator's, or a store.StoreGroup's);
        ``crowded``: this rank's machine has more processes than cores (hosts.crowded_host)."""
        rank, size = group.rank, group.size
        config = group.allgather(_config_from_env())[0]  # rank 0's: every rank must agree
        # Spinning on a core that a peer needs only delays it: no spinning when ranks
        # outnumber cores.
        spin = 0 if any(group.allgather(crowded)) else int(os.environ.get("COMMLIB_SHM_SPIN",
                                                                           20_000))
        transport, error = None, None
        try:
            transport = _C.ShmComm(rank, size, spin=spin, yields=200, **config)
        except (RuntimeError, ValueError) as e:
            error = e
        names = group.allgather(transport.name if transport else None)
        if transport and None not in names:
            try:
                transport.attach(names)
            except RuntimeError as e:
                error = e
        # every rank has mapped every segment (or given up): unlink, so a crash leaves nothing
        failed = any(group.allgather(error is not None))
        if transport:
            transport.unlink_own()
        if failed:
            raise CommError(f"shared-memory set-up failed: {error or 'on another rank'}; "
                            "set COMMLIB_TRANSPORT=mpi to run without it")
        self.transport = transport
        self.timeout = transport.timeout
        self.group = group  # for later set-ups among the same ranks (commlib/transports/cuda_ipc.py)

    plan = staticmethod(plan_for)

    def set_timeout(self, seconds: float) -> None:
        """Seconds a call may wait for its peers (0: forever), from the next call on."""
        self.timeout = self.transport.timeout = seconds

    def run(self, plan: ShmPlan, bufs: dict, dtype_code: int, op_code: int) -> None:
        inp = bufs.get("in")
        self.transport.run_plan(plan.steps, bufs["out"].ptr, inp.ptr if inp else 0,
                                plan.tmp_bytes, dtype_code, op_code)

    def barrier(self) -> None:
        self.transport.barrier()

    @property
    def bytes_sent(self) -> int:
        return self.transport.bytes_sent
