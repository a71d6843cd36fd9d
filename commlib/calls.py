"""What a communicator knows about its collective calls: what the ranks must agree on (the
descriptor), how long a call may wait (the timeout), and the last calls it made (the flight
recorder).

- descriptor: eight int64 fields (csrc/agreement.h): collective, algorithm (name packed
  into 8 bytes), count, dtype, op, root, variant, reserved; _C.NONE where a field does not
  apply. The shared-memory transport publishes it in shared memory with every call; other
  transports exchange it (Agreement) before the call moves data.
- timeout: COMMLIB_TIMEOUT seconds (default 600, 0 = none), per communicator
  (``comm.timeout``) and per call (``timeout=``).
- flight recorder: the last COMMLIB_FLIGHT_RECORDER (default 64) calls of a communicator,
  with sequence number, arguments, state and timings; ``comm.flight_record()`` returns
  them and a timeout or mismatch prints them to stderr.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque

import numpy as np
from mpi4py import MPI

from . import _C
from .work import Deadline, wait_all_requests

NONE = _C.NONE
_now = time.monotonic
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce")


def _env_number(name: str, default: float, kind=float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}; expected a number") from None
    if number < 0:
        raise ValueError(f"{name}={value!r}; expected a number >= 0")
    return number


def default_timeout() -> float:
    """COMMLIB_TIMEOUT: seconds a collective may wait for its peers (0: no limit)."""
    return _env_number("COMMLIB_TIMEOUT", 600.0)


def check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 (0: none), got {timeout!r}")
    return float(timeout)


def pack_name(name: str) -> int:
    """An algorithm's name as csrc/agreement.h packs it: up to 8 ASCII bytes, little-endian."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little", signed=True)


def descriptor(collective: str, algorithm: str, count: int, dtype_code: int, op_code: int,
               root) -> list:
    return [_C.COLLECTIVES[collective], pack_name(algorithm),
            NONE if collective == "all_to_all" else count, dtype_code,
            op_code if collective in REDUCING else NONE,
            root if collective in ROOTED else NONE, 0, 0]


def invalid_descriptor(collective: str) -> list:
    """What a rank whose arguments failed validation publishes instead (agreement.h)."""
    return [_C.COLLECTIVES[collective], NONE, NONE, NONE, NONE, NONE, _C.INVALID, 0]


AGREEMENT_TAG = 6  # on the collective communicator; the mpi4py executor uses 7


class Agreement:
    """Checks that every rank of an MPI communicator makes the same call: each sends its
    descriptor (and all_to_all's splits) to every other, then all raise
    CollectiveMismatchError alike if they differ. Point to point rather than one allgather
    so that a timeout can name the ranks that never arrived. Calls on a communicator run
    one at a time, so one table and one set of persistent requests serve them all (starting
    those costs far less than posting new ones)."""

    def __init__(self, mpi_comm):
        size, me = mpi_comm.Get_size(), mpi_comm.Get_rank()
        # one message size for every call: a row is 8 fields, then bytes sent and
        # received per peer (all_to_all only); no message is ever truncated
        self.table = np.zeros((size, 8 + 2 * size), np.int64)
        self.mine = self.table[me]
        peers = [p for p in range(size) if p != me]
        self.requests = ([mpi_comm.Recv_init(self.table[p], p, AGREEMENT_TAG) for p in peers]
                         + [mpi_comm.Send_init(self.mine, p, AGREEMENT_TAG) for p in peers])
        self.peers = [f"rank {p}" for p in peers] * 2

    def check(self, desc: list, itemsize: int, splits=None, timeout=0.0) -> None:
        self.mine[:8] = desc
        if splits:
            self.mine[8:] = list(splits[0]) + list(splits[1])
        MPI.Prequest.Startall(self.requests)
        if not MPI.Request.Testall(self.requests):
            wait_all_requests(self.requests, self.peers, Deadline(timeout),
                              "to start the same collective", keep=self.table)
        _C.check_agreement(self.table, itemsize, bool(splits))

    def free(self) -> None:
        for request in self.requests:
            if request and not request.Test():  # abandoned after a timeout: MPI keeps it
                continue
            request.Free()


class FlightRecorder:
    """The last ``size`` calls: [seq, collective, algorithm, count, dtype, op, root, state,
    issued, started, finished, error] per call, kept as plain lists (cheap to record)."""

    FIELDS = ("seq", "collective", "algorithm", "count", "dtype", "op", "root", "state",
              "issued", "started", "finished", "error")

    def __init__(self, owner: str, size: int | None = None):
        self.owner = owner
        self.calls: deque = deque(maxlen=int(_env_number("COMMLIB_FLIGHT_RECORDER", 64, int))
                                  if size is None else size)
        self.seq = 0
        self.fast = None  # the communicator's FastPath: it numbers every call, keeps its rows

    def issue(self, collective, algorithm, count, dtype, op=None, root=None) -> list:
        self.seq = self.fast.native.next_seq() if self.fast is not None else self.seq + 1
        record = [self.seq, collective, algorithm, count, dtype, op, root, "issued",
                  _now(), None, None, None]
        self.calls.append(record)
        return record

    @staticmethod
    def start(record) -> None:
        record[7], record[9] = "running", _now()

    @staticmethod
    def finish(record, error: BaseException | None = None) -> None:
        record[10] = _now()
        if record[9] is None:  # failed before it started
            record[9] = record[8]
        if error is None:
            record[7] = "done"
        else:
            record[7], record[11] = "failed", f"{type(error).__name__}: {error}"

    def detach(self) -> None:
        """Keep the fast path's rows but not the fast path (it holds the transport's
        memory): for a communicator being freed."""
        if self.fast is not None:
            rows = self.rows()
            self.seq = self.fast.native.next_seq() - 1
            self.fast = None
            self.calls.clear()
            self.calls.extend(rows)

    def rows(self) -> list[list]:
        """Both paths' calls, oldest first, at most as many as the recorder keeps."""
        rows = list(self.calls)
        if self.fast is not None and self.calls.maxlen:
            rows = sorted(rows + self.fast.records(), key=lambda r: r[0])[-self.calls.maxlen:]
        return rows

    def records(self) -> list[dict]:
        out = []
        for r in self.rows():
            d = dict(zip(self.FIELDS, r))
            d["dtype"] = str(d["dtype"]) if d["dtype"] is not None else None
            out.append(d)
        return out

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
