"""The fast path: a whole collective on numpy arrays in one C++ call (csrc/fast_path.cpp,
whose header tells how), so that a small collective costs one Python frame and one C++
call instead of the general path's few microseconds (commlib/dispatch.py). It runs only
what the general path decided: each call the general path plans on host memory teaches it
that call's plan or direct collective, under the algorithm asked for (or auto). Calls are
recorded either way (it keeps its rows in C++; recorder.FlightRecorder merges them).
Where the transport has one (shm); ``COMMLIB_FAST_PATH=0`` turns it off.
"""
from __future__ import annotations

import weakref

from . import _C, user_ops
from .call import NONE, ReduceOp
from .collectives import CODES, NAMES, ROOTED
from .dtypes import BY_CODE
from .recorder import Record
from .work import keep_for_good

# what a reducing collective's op may be given as (as ReduceOp.parse takes it)
_OP_CODES = {**{o.value: _C.OPS[o.value] for o in ReduceOp},
             **{o: _C.OPS[o.value] for o in ReduceOp}}
_OP_NAMES = {code: name for name, code in _C.OPS.items()}


def accept(op) -> None:
    """Take user-defined ``op`` (commlib/user_ops.py) as calls give it."""
    _OP_CODES[op] = op.code
    _OP_NAMES[op.code] = op.name


user_ops.on_define(accept)


class FastPath:
    def __init__(self, native, algorithms: dict, kinds: frozenset):
        self.native = native
        self.kinds = kinds  # the entries the transport runs (csrc/fast_path.h)
        # call(collective code, a, b, op, root, algorithm) -> True, or False: the general
        # path's call
        self.call = native.call
        self.algorithms = algorithms  # name asked for -> id (shared with C++; auto is 0)
        self.entries: list[tuple] = []  # entry id -> (algorithm name, count) for the record
        self.plans_agree = False  # whether the transport agrees on a plan's call first (net)

    @classmethod
    def create(cls, transport, calls, timeout: float) -> "FastPath | None":
        """``transport``'s fast path, recording into ``calls`` (a dispatch.Dispatcher)."""
        # (through a weak reference: the collector cannot see what C++ holds, so a bound
        # method there would keep the Calls, and the transport, alive for good)
        owner = weakref.ref(calls)
        algorithms: dict = {}
        native = transport.fast_path(
            op_codes=_OP_CODES, algorithms=algorithms, timeout=timeout,
            records=calls.recorder.calls.maxlen,
            on_failure=lambda *failure: _failed(owner(), *failure))
        if native is None:
            return None
        made = cls(native, algorithms, transport.fast_kinds)
        made.plans_agree = transport.plans_agree and transport.checks_calls
        return made

    def learn(self, call, requested: str | None, algo, plan, otherwise=None) -> None:
        """The general path runs ``algo`` (``plan``, or a runner) for ``call``, asked for
        ``requested`` (None: auto); a one_copy that stages by a schedule, by its plan
        ``otherwise`` (and reads in place only in regions where ``algo.only_regions``)."""
        if call.splits is not None and len(set(call.splits[0] + call.splits[1])) > 1:
            return  # the fast path knows equal parts only
        kind = "plan" if plan is not None else algo.name
        if kind not in self.kinds:
            return  # other runners (MPI's own, hier, MPI's plans) stay on the general path
        algorithm = 0 if requested is None else self.algorithms.setdefault(
            requested, len(self.algorithms) + 1)
        staged = plan if kind == "plan" else otherwise
        steps, tmp = (staged.steps.tolist(), staged.tmp_bytes) if staged is not None else ([], 0)
        # eager sends its descriptor, native agrees on it first, and so do rooted plans
        # (transports/shm.py): dtype and op are filled in per call
        needs_descriptor = kind in ("eager", "native") or (
            kind == "plan" and (call.collective in ROOTED or self.plans_agree))
        self.native.learn(CODES[call.collective], algorithm, call.count, call.dtype.itemsize,
                          NONE if call.root is None else call.root, kind, steps, tmp,
                          len(self.entries), call.descriptor(algo.name) if needs_descriptor
                          else [], algo.only_regions)
        self.entries.append((algo.name, call.count))

    def forget_auto(self) -> None:
        """Forget what auto chose: a new algorithm table may choose otherwise."""
        self.native.forget(0)

    def records(self) -> list[Record]:
        """The flight recorder's rows for the calls run here (recorder.FlightRecorder)."""
        rows = []
        for seq, collective, entry, dtype, op, root, issued, finished in self.native.records():
            algorithm, count = self.entries[entry]
            rows.append(Record(seq, NAMES[collective], algorithm, count, BY_CODE[dtype].name,
                               _OP_NAMES.get(op), None if root == NONE else root, "done",
                               issued, issued, finished))
        return rows


def _failed(calls, collective: int, op: int, root: int, issued: float, kind: str,
            message: str, arrays: tuple) -> Exception:
    """A fast-path call failed: record it as the general path would; the error to raise.
    After a timeout its ``arrays`` are kept for good, as MPI (native entries) may still
    hold them."""
    if kind == "CommTimeoutError":
        keep_for_good(arrays)
    record = calls.recorder.issue(NAMES[collective], None, None, None, _OP_NAMES.get(op),
                                  None if root == NONE else root)
    record.issued = issued
    return calls.finish(record, getattr(_C, kind)(message))
