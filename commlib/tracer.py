"""This rank's part of the timeline (commlib/trace.py says what the timeline is): the tracer
that COMMLIB_TRACE (from ``commlib.init()``) or a window (``trace.tracing``) keeps, the
regions the program marks, and the job's responder, with which a failed call gathers every
rank's last calls into a timeline named on its error. The communicator's layers (comm.py at
init, dispatch.py on a failure) call this module; it imports none of them.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import settings
from .dtypes import DTYPES
from .recorder import FlightRecorder, default_size
from .responder import Responder, ask
from .timeline import chrome_trace

_ROUNDS = 8  # ping-pongs per rank when measuring clock offsets
_TAG = 32766


def directory() -> Path | None:
    """Where this process writes its trace (COMMLIB_TRACE), or None."""
    where = settings.get("COMMLIB_TRACE")
    return Path(where) if where else None


class Tracer:
    """This rank's trace: the world rank, the clock offset to rank 0, and the recorders of
    the communicators it covers (kept even after they are freed); a window's covers the
    calls issued ``since`` (time.monotonic()), else all."""

    def __init__(self, where: Path, world, recorders, since: float | None = None):
        self.where, self.rank, self.size = where, world.rank, world.size
        self.offset = clock_offset(world)
        self.recorders: list = list(recorders)  # and every one made from now on
        self.since = since
        self.regions: list = []  # (name, start, end): what the program was doing
        FlightRecorder.on_create = self.recorders.append

    def content(self) -> dict:
        """This rank's trace file's content: its calls so far."""
        return {"rank": self.rank, "size": self.size, "host": socket.gethostname(),
                "pid": os.getpid(), "offset": self.offset, "regions": list(self.regions),
                "communicators": [_communicator(r, self.since) for r in list(self.recorders)]}

    def write(self) -> Path:
        """Write this rank's calls so far to ``DIR/rank-NNNNN.json``."""
        self.where.mkdir(parents=True, exist_ok=True)
        path = self.where / f"rank-{self.rank:05d}.json"
        _write(path, self.content())
        return path


def _communicator(recorder, since: float | None = None) -> dict:
    calls = [c for c in recorder.records() if since is None or c["issued"] >= since]
    for call in calls:
        dtype = DTYPES.get(call["dtype"]) if call["dtype"] else None
        call["bytes"] = (call["count"] or 0) * (dtype.itemsize if dtype else 0)
    return {"name": recorder.owner, "members": list(recorder.members),
            "ordinal": recorder.ordinal, "calls": calls}


def _write(path: Path, content: dict) -> None:
    """Write JSON whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content))
    tmp.replace(path)


def clock_offset(world) -> float:
    """This rank's time.monotonic() minus rank 0's (0 on rank 0); collective over
    ``world``. Rank 0 ping-pongs each rank in turn and keeps the exchange with the shortest
    round trip: the offset is then off by at most half of it."""
    ping, pong = np.zeros(1), np.zeros(2)
    if world.rank != 0:
        for _ in range(_ROUNDS):
            world.recv(ping, 0, _TAG)
            pong[0] = time.monotonic()
            world.send(pong, 0, _TAG)
        world.recv(ping, 0, _TAG)  # rank 0's verdict
        return float(ping[0])
    for peer in range(1, world.size):
        best, offset = float("inf"), 0.0
        for _ in range(_ROUNDS):
            sent = time.monotonic()
            world.send(ping, peer, _TAG)
            world.recv(pong, peer, _TAG)
            back = time.monotonic()
            if back - sent < best:
                best, offset = back - sent, pong[0] - (sent + back) / 2
        world.send(np.array([offset]), peer, _TAG)
    return 0.0


_tracer: Tracer | None = None  # this process's trace, if COMMLIB_TRACE asked for one
_job: "_Job | None" = None  # the job this process is a rank of, for failures' timelines


class _Job:
    """The job (rank 0's host and pid, the same on every rank), this rank in it, and how to
    reach every rank's responder (commlib/responder.py) when a call fails."""

    def __init__(self, meeting, rank: int, size: int):
        hosts_and_names = meeting.allgather(
            (socket.gethostname(), f"{socket.gethostname()}-{os.getpid()}" if rank == 0
             else None, secrets.token_hex(16) if rank == 0 else None))
        hosts = [host for host, _, _ in hosts_and_names]
        _, self.name, self.token = hosts_and_names[0]
        self.rank, self.size = rank, size
        self.responder = Responder(self.token, lambda: snapshot(self),
                                   loopback=len(set(hosts)) == 1)
        ports = meeting.allgather(self.responder.port)
        here = hosts[rank]
        self.peers = {r: ("127.0.0.1" if host == here else host, port)
                      for r, (host, port) in enumerate(zip(hosts, ports)) if r != rank}


def name_job(meeting, rank: int, size: int) -> None:
    """Remember the job and start this rank's responder, for failures' timelines;
    collective over the world's ``meeting`` (its allgather)."""
    global _job
    _job = _Job(meeting, rank, size)


def end_job() -> None:
    """Stop answering for the job: its world was freed (commlib.finalize)."""
    global _job
    if _job is not None:
        _job.responder.close()
        _job = None


def _live_recorders() -> list:
    """Every live communicator's flight recorder, the world's first (the widest, then by
    members and creation)."""
    return sorted(FlightRecorder.alive, key=lambda r: (-len(r.members), r.members, r.ordinal))


def snapshot(job: _Job) -> dict:
    """This rank's trace file's content now: the trace's, when tracing, else the last calls
    of every live communicator (clock offset 0: the reader puts it on its own clock)."""
    if _tracer is not None:
        return _tracer.content()
    recorders = _live_recorders()
    return {"rank": job.rank, "size": job.size, "host": socket.gethostname(),
            "pid": os.getpid(), "offset": 0.0, "regions": [],
            "communicators": [_communicator(r) for r in recorders]}


def on_failure(error: BaseException) -> None:
    """A call failed (a timeout, a disagreement, a dead peer): ask every rank of the job for
    its last calls (those that answer in responder.ASK_SECONDS), put them on rank 0's
    clock (this rank's, if rank 0 does not answer), write them where every rank writes
    its own (COMMLIB_TRACE, else a directory in the temporary directory named after the
    job), merge them into ``trace.json``, and say where in a note on ``error``."""
    if _job is None:
        return
    where = directory() or Path(tempfile.gettempdir()) / f"commlib-failure-{_job.name}"
    ranks = {_job.rank: (snapshot(_job), 0.0), **ask(_job.peers, _job.token)}
    base = ranks[0][1] if 0 in ranks else 0.0
    try:
        where.mkdir(parents=True, exist_ok=True)
        for rank, (content, offset) in ranks.items():
            content["offset"] = offset - base
            _write(where / f"rank-{rank:05d}.json", content)
        _write(where / "trace.json", chrome_trace([ranks[r][0] for r in sorted(ranks)]))
    except OSError as e:
        error.add_note(f"commlib: writing the failure's timeline to {where} failed: {e}")
        return
    missing = sorted(set(range(_job.size)) - set(ranks))
    error.add_note(f"commlib: the last calls of the {len(ranks)} of {_job.size} ranks that "
                   f"answered: {where / 'trace.json'} (ui.perfetto.dev; redraw it with "
                   f"python -m commlib.trace {where})"
                   + (f"; no answer from rank{'s' * (len(missing) > 1)} "
                      f"{', '.join(map(str, missing[:16]))}{', ...' * (len(missing) > 16)} "
                      "(dead, stopped, or holding the interpreter)" if missing else ""))


def start(world, recorder: FlightRecorder) -> Tracer | None:
    """Begin tracing if COMMLIB_TRACE asks for it (collective over ``world``, whose flight
    recorder is ``recorder``)."""
    global _tracer
    where = directory()
    if where is not None:
        _tracer = Tracer(where, world, [recorder])
        atexit.register(_tracer.write)
    return _tracer


def current() -> Tracer | None:
    """This process's tracer (COMMLIB_TRACE's, or a window's), if any."""
    return _tracer


def begin_window(where: Path, world, since: float) -> Tracer:
    """Trace every communicator's calls issued from ``since`` on (collective over
    ``world``): the live recorders and every one made meanwhile keep COMMLIB_TRACE_CALLS
    calls until ``end_window``."""
    global _tracer
    if _tracer is not None:
        raise RuntimeError("commlib.trace.tracing: already tracing (COMMLIB_TRACE, or a "
                           "window around this one); one trace at a time")
    calls = settings.get("COMMLIB_TRACE_CALLS")
    recorders = _live_recorders()
    for r in recorders:
        r.keep(calls)
    tracer = _tracer = Tracer(where, world, recorders, since=since)
    FlightRecorder.on_create = lambda r: (r.keep(calls), tracer.recorders.append(r))
    return tracer


def end_window(tracer: Tracer) -> None:
    """The window's end: its calls written, the recorders back to their usual size."""
    global _tracer
    FlightRecorder.on_create, _tracer = None, None
    tracer.write()
    for r in tracer.recorders:
        r.keep(default_size())


@contextmanager
def region(name: str):
    """Mark what the program does meanwhile (a training step's forward, backward, ...) on
    this rank's timeline, beside its calls; nothing when not tracing."""
    if _tracer is None:
        yield
        return
    begun = time.monotonic()
    try:
        yield
    finally:
        _tracer.regions.append((name, begun, time.monotonic()))
