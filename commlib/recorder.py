"""The flight recorder: the last COMMLIB_FLIGHT_RECORDER (default 64; under COMMLIB_TRACE,
COMMLIB_TRACE_CALLS, default 100000) calls of a communicator, with sequence number,
arguments, state and timings; ``comm.flight_record()`` returns them, a timeout or mismatch
prints them to stderr, and a trace (commlib/tracer.py) writes them out."""
from __future__ import annotations

import sys
import time
import weakref
from collections import Counter, deque

from . import settings


_now = time.monotonic
FIELDS = ("seq", "collective", "algorithm", "count", "dtype", "op", "root", "state", "issued",
          "started", "finished", "error")


class Record:
    """One call a flight recorder keeps: its arguments, its state ("issued", "running",
    "done", "failed") and its times (time.monotonic's), updated as it runs."""
    __slots__ = FIELDS

    def __init__(self, seq, collective, algorithm, count, dtype, op=None, root=None,
                 state="issued", issued=None, started=None, finished=None, error=None):
        self.seq, self.collective, self.algorithm, self.count = seq, collective, algorithm, count
        self.dtype, self.op, self.root, self.state = dtype, op, root, state
        self.issued, self.started, self.finished, self.error = issued, started, finished, error

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name in FIELDS}
        d["dtype"] = str(d["dtype"]) if d["dtype"] is not None else None
        return d


def busy_seconds(since: float, until: float) -> float:
    """Seconds within [since, until] (time.monotonic's clock) during which a call of this
    process was running, on any communicator: the union of the calls' [started, finished]
    (one still running counts to ``until``), from what the recorders keep (keep_calls)."""
    spans = []
    for recorder in list(FlightRecorder.alive):
        for r in reversed(recorder.rows()):  # (newest first: stop at the window's start)
            if r.finished is not None and r.finished <= since and r.issued < since:
                break
            if r.started is not None and r.started < until and (r.finished is None
                                                                  or r.finished > since):
                spans.append((max(r.started, since),
                               min(until if r.finished is None else r.finished, until)))
    total, reach = 0.0, since
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def keep_calls(calls: int) -> None:
    """The recorder of every communicator alive now keeps at least its last ``calls``
    calls: what busy_seconds reads over a window as long as a step."""
    for recorder in list(FlightRecorder.alive):
        if recorder.calls.maxlen < calls:
            recorder.keep(calls)


def default_size() -> int:
    if settings.get("COMMLIB_TRACE"):
        return settings.get("COMMLIB_TRACE_CALLS")
    return settings.get("COMMLIB_FLIGHT_RECORDER")


class FlightRecorder:
    """The last ``size`` calls, a Record each."""

    on_create = None  # a trace's: called with every new recorder (commlib/tracer.py)
    alive: weakref.WeakSet = weakref.WeakSet()  # every recorder of this process (trace windows)
    _made: Counter = Counter()  # communicators identified so far, by members

    def __init__(self, owner: str, size: int | None = None):
        self.owner = owner
        self.calls: deque = deque(maxlen=default_size() if size is None else size)
        self.seq = 0
        self.fast = None  # the communicator's FastPath: it numbers every call, keeps its rows
        self.members: tuple = ()  # the world ranks of the communicator's ranks
        self.ordinal = 0  # how many communicators of the same members this process made before
        FlightRecorder.alive.add(self)
        if FlightRecorder.on_create is not None:
            FlightRecorder.on_create(self)

    def identify(self, members) -> None:
        """Name the communicator as every member names it: its members' world ranks and how
        many communicators of those members came before (made collectively, so in the same
        order everywhere); a trace matches calls across ranks by it and the seq."""
        self.members = tuple(members)
        self.ordinal = FlightRecorder._made[self.members]
        FlightRecorder._made[self.members] += 1

    def keep(self, size: int) -> None:
        """Keep the last ``size`` calls from now on (on both paths)."""
        self.calls = deque(self.calls, maxlen=size)
        if self.fast is not None:
            self.fast.native.keep(size)

    def issue(self, collective, algorithm, count, dtype, op=None, root=None) -> Record:
        self.seq = self.fast.native.next_seq() if self.fast is not None else self.seq + 1
        record = Record(self.seq, collective, algorithm, count, dtype, op, root,
                        issued=_now())
        self.calls.append(record)
        return record

    @staticmethod
    def start(record: Record) -> None:
        record.state, record.started = "running", _now()

    @staticmethod
    def finish(record: Record, error: BaseException | None = None) -> None:
        record.finished = _now()
        if record.started is None:  # failed before it started
            record.started = record.issued
        if error is None:
            record.state = "done"
        else:
            record.state, record.error = "failed", f"{type(error).__name__}: {error}"

    def detach(self) -> None:
        """Keep the fast path's rows but not the fast path (it holds the transport's
        memory): for a communicator being freed."""
        if self.fast is not None:
            rows = self.rows()
            self.seq = self.fast.native.next_seq() - 1
            self.fast = None
            self.calls.clear()
            self.calls.extend(rows)

    def rows(self) -> list[Record]:
        """Both paths' calls, oldest first, at most as many as the recorder keeps."""
        rows = list(self.calls)
        if self.fast is not None and self.calls.maxlen:
            rows = sorted(rows + self.fast.records(), key=lambda r: r.seq)[-self.calls.maxlen:]
        return rows

    def records(self) -> list[dict]:
        return [r.as_dict() for r in self.rows()]

    def dump(self, file=None) -> str:
        """The recorded calls as a table, oldest first; written to ``file`` (stderr)."""
        if not self.calls.maxlen:
            return ""
        now = time.monotonic()
        records = self.records()
        lines = [f"commlib flight recorder: {self.owner}, last {len(records)} calls "
                 f"(times in ms before now)"]
        lines.append(f"{'seq':>6} {'state':8} {'collective':15} {'algorithm':9} {'count':>10} "
                     f"{'dtype':9} {'op':5} {'root':>4} {'issued':>9} {'started':>9} "
                     f"{'took':>9}  error")
        ms = lambda t: f"{(now - t) * 1e3:9.1f}" if t is not None else f"{'-':>9}"  # noqa: E731
        for d in records:
            took = (f"{(d['finished'] - d['started']) * 1e3:9.3f}"
                    if d["finished"] is not None and d["started"] is not None else f"{'-':>9}")
            shown = {k: "-" if v is None else v for k, v in d.items()}
            lines.append(f"{d['seq']:>6} {d['state']:8} {d['collective']:15} "
                         f"{shown['algorithm']:9} {shown['count']:>10} {shown['dtype']:9} "
                         f"{shown['op']:5} {shown['root']:>4} {ms(d['issued'])} "
                         f"{ms(d['started'])} {took}  {d['error'] or ''}")
        text = "\n".join(lines) + "\n"
        print(text, file=file or sys.stderr, end="", flush=True)
        return text
