"""The fast path: a whole collective on numpy arrays in one C++ call (csrc/fast_path.cpp).

The general path (collectives.py) validates, plans and records a call in Python, which
costs a few microseconds: more than a small collective on shared memory takes. The fast
path runs only what the general path already decided: each time the general path plans a
call (``Communicator._plan``, no algorithm named), it teaches the fast path that call's
plan or direct collective. A later call with the same (collective, count, itemsize,
root) on numpy arrays runs in one C++ call, checked there; anything it does not check
itself goes to the general path, which raises the usual errors. Calls are recorded in
the flight recorder either way (the fast path keeps its rows in C++; calls.FlightRecorder
merges them).

The C++ call checks everything itself, including whether the general path owns the
communicator (a *hold*: its progress engine has work, or the communicator failed), so that
a small collective costs one Python frame and one C++ call.

Only on the shared-memory transport; ``COMMLIB_FAST_PATH=0`` turns it off.
"""
from __future__ import annotations

import os
import weakref

from . import _C
from .calls import NONE
from .ops import ReduceOp

# what a reducing collective's op may be given as (as ReduceOp.parse takes it)
_OP_CODES = {**{o.value: _C.OPS[o.value] for o in ReduceOp},
             **{o: _C.OPS[o.value] for o in ReduceOp}}
_OP_NAMES = {code: name for name, code in _C.OPS.items()}
_COLLECTIVE_NAMES = {code: name for name, code in _C.COLLECTIVES.items()}
_DTYPE_NAMES = {code: name for name, code in _C.DTYPES.items()}


def enabled(transport: str) -> bool:
    return transport == "shm" and os.environ.get("COMMLIB_FAST_PATH", "1") != "0"


class FastPath:
    def __init__(self, comm, records: int):
        self.comm = comm
        # (through a weak reference: the collector cannot see what C++ holds, so a bound
        # method there would keep this object, and the transport, alive for good)
        me = weakref.ref(self)
        self.native = _C.FastPath(comm._executor.transport, _OP_CODES, comm.timeout, records,
                                  lambda *failure: me()._failed(*failure))
        # call(collective code, a, b, op, root) -> True, or False: the general path's call
        self.call = self.native.call
        self.entries: list[tuple] = []  # entry id -> (algorithm name, count) for the record

    @property
    def taken(self) -> int:
        """Calls run on this path so far."""
        return self.native.taken

    def learn(self, collective: str, algo, plan, count: int, itemsize: int,
              params: dict) -> None:
        """The general path runs ``algo`` (``plan``, or a runner when None) for this call."""
        comm, name = self.comm, algo.name
        if collective == "all_to_all":  # the fast path knows equal parts only
            if count % comm.size or any(
                    s != count // comm.size for k in ("input_splits", "output_splits")
                    for s in params[k]):
                return
        if plan is None and name != "direct":
            return  # other runners (MPI's own, hier) stay on the general path
        steps, tmp = (plan.steps.tolist(), plan.tmp_bytes) if plan is not None else ([], 0)
        self.native.learn(_C.COLLECTIVES[collective], count, itemsize,
                          params.get("root", NONE), steps, tmp, len(self.entries))
        self.entries.append((name, count))

    def _failed(self, collective: int, op: int, root: int, issued: float, kind: str,
                message: str) -> Exception:
        """A call here failed: record it as the general path would; the error to raise."""
        comm = self.comm
        record = comm._recorder.issue(_COLLECTIVE_NAMES[collective], None, None, None,
                                      _OP_NAMES.get(op), None if root == NONE else root)
        record[8] = issued
        return comm._finish(record, getattr(_C, kind)(message))

    def records(self) -> list[list]:
        """The flight recorder's rows for the calls run here (calls.FlightRecorder)."""
        rows = []
        for seq, collective, entry, dtype, op, root, issued, finished in self.native.records():
            algorithm, count = self.entries[entry]
            rows.append([seq, _COLLECTIVE_NAMES[collective], algorithm, count,
                         _DTYPE_NAMES[dtype], _OP_NAMES.get(op), None if root == NONE else root,
                         "done", issued, issued, finished, None])
        return rows
