"""A timeline of every rank's communication: each rank records its calls, and
``python -m commlib.trace DIR -o trace.json`` merges them into one Chrome trace (a track per
rank, a row per communicator) that opens in ui.perfetto.dev and chrome://tracing;
``--png FILE`` draws the same as a swimlane picture.

    COMMLIB_TRACE=/tmp/run mpiexec -n 4 python train.py
    python -m commlib.trace /tmp/run -o trace.json --png trace.png

or a window of a run, ``with commlib.trace.tracing("/tmp/run"): ...`` on every rank.

With COMMLIB_TRACE set, ``commlib.init()`` measures each rank's clock against rank 0's
(ping-pongs over the world: the offset of the exchange with the shortest round trip, so
ranks on other hosts line up too), every communicator keeps its last COMMLIB_TRACE_CALLS
(100000) calls in its flight recorder (commlib/recorder.py: collective, algorithm, count,
dtype, issue, start and end times, state, error), ``region(name)`` marks what the program
does meanwhile (the trainer's forward, backward and optimizer step), and at exit each rank
writes ``DIR/rank-NNNNN.json``. A communicator is named alike on its members (their world
ranks, and how many communicators of theirs came before), so the merge matches each call
across its ranks and says whom each rank waited for and how long: the peers that started it
later (``waited_for``, ``waited_us``, ``late_peers`` in the call's arguments). Ranks on
hosts that share no file system write their files on their own host: copy the directories
together, or name them all (``python -m commlib.trace host1/run host2/run``).

When a call fails (a timeout, a disagreement, a dead peer), each rank that sees it asks every
rank of the job for its last calls (commlib/responder.py: each answers from a thread, on any
host, whether in a call or not) and writes those that answer, on one clock, with a merged
``trace.json`` (in COMMLIB_TRACE, else ``commlib-failure-JOB`` in the temporary directory),
named in a note on the error: the ranks stuck elsewhere show where they are. Recording
costs what the flight recorder always costs: a row per call, on either path; without
COMMLIB_TRACE nothing more is kept.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import settings
from .dtypes import DTYPES
from .recorder import FlightRecorder, default_size
from .recorder import busy_seconds as recorder_busy, keep_calls as recorder_keep_calls
from .responder import Responder, ask
from .work import own_cpu_seconds as work_own_cpu_seconds

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


@contextmanager
def tracing(where):
    """Trace every communicator's calls issued inside, as COMMLIB_TRACE traces a whole run:
    collective over the world (every rank enters and leaves it); at the exit each rank writes
    ``where/rank-NNNNN.json`` for ``python -m commlib.trace where`` to merge. Meanwhile the
    recorders keep COMMLIB_TRACE_CALLS calls (100000), then their usual number again."""
    global _tracer
    from .comm import init
    if _tracer is not None:
        raise RuntimeError("commlib.trace.tracing: already tracing (COMMLIB_TRACE, or a "
                           "window around this one); one trace at a time")
    world = init()
    calls = settings.get("COMMLIB_TRACE_CALLS")
    recorders = _live_recorders()
    for r in recorders:
        r.keep(calls)
    tracer = _tracer = Tracer(Path(where), world, recorders, since=time.monotonic())
    FlightRecorder.on_create = lambda r: (r.keep(calls), tracer.recorders.append(r))
    try:
        yield tracer
    finally:
        FlightRecorder.on_create, _tracer = None, None
        tracer.write()
        for r in tracer.recorders:
            r.keep(default_size())


# ---------------------------------------------------------------------------- a step's time
def busy_seconds(since: float, until: float) -> float:
    """Seconds within [since, until] (time.monotonic's clock) during which some call of
    this process was running, on any communicator (recorder.busy_seconds): a step's
    communication, beside its compute (own_cpu_seconds)."""
    return recorder_busy(since, until)


keep_calls = recorder_keep_calls  # every recorder keeps at least N calls (for busy_seconds)
own_cpu_seconds = work_own_cpu_seconds  # CPU seconds of commlib's own threads so far


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


# ---------------------------------------------------------------------------- merging

def load(where, complete: bool = True) -> list[dict]:
    """Every rank's trace file in ``where`` (a directory, or several: each host's, copied
    from hosts that share no file system), by rank (with ``complete``, one per rank of the
    world, or ValueError)."""
    wheres = [where] if isinstance(where, (str, Path)) else list(where)
    files = [f for w in wheres for f in sorted(Path(w).glob("rank-*.json"))]
    if not files:
        raise FileNotFoundError(f"no rank-*.json in {', '.join(map(str, wheres))}; run with "
                                f"COMMLIB_TRACE=DIR")
    ranks = {}
    for f in files:
        content = json.loads(f.read_text())
        if content["rank"] in ranks:
            raise ValueError(f"rank {content['rank']} has two trace files ({f} and another); "
                             "merge the directories of one run only")
        ranks[content["rank"]] = content
    sizes = {r["size"] for r in ranks.values()}
    if complete and (len(sizes) != 1 or len(ranks) != sizes.pop()):
        raise ValueError(f"{', '.join(map(str, wheres))}: {len(ranks)} rank files of a world "
                         f"of {sorted({r['size'] for r in ranks.values()})} ranks; a rank did "
                         "not write its trace (did it exit early? on another host: copy its "
                         "directory here and name both)")
    return [ranks[k] for k in sorted(ranks)]


def cropped(trace: dict, first_ms: float, last_ms: float) -> dict:
    """``trace`` with only the events that overlap [first_ms, last_ms], cut to it and
    shifted to start at first_ms."""
    kept = []
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            end = min(e["ts"] + e["dur"], last_ms * 1e3)
            start = max(e["ts"], first_ms * 1e3)
            if end < start:
                continue
            e = {**e, "ts": start - first_ms * 1e3, "dur": end - start}
        kept.append(e)
    return {**trace, "traceEvents": kept}


def chrome_trace(ranks: list[dict]) -> dict:
    """The Chrome trace (JSON object format) of ``ranks``: a process per rank, a thread per
    communicator, a complete event per call from its start to its end (its queueing before
    the start in the arguments), times in microseconds on rank 0's clock from the first
    call."""
    calls = [(r, c, call) for r in ranks for c in r["communicators"] for call in c["calls"]
             if call["started"] is not None]
    origin = min([call["issued"] - r["offset"] for r, _, call in calls] +
                 [begun - r["offset"] for r in ranks for _, begun, _ in r["regions"]],
                 default=0.0)
    events = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r["rank"],
                       "args": {"name": f"rank {r['rank']} ({r['host']})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r["rank"],
                       "args": {"sort_index": r["rank"]}})
        for tid, c in enumerate(r["communicators"]):
            events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": tid,
                           "args": {"name": c["name"]}})
        below = len(r["communicators"])  # the regions' row, under the communicators'
        events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": below,
                       "args": {"name": "regions"}})
        for name, begun, ended in r["regions"]:
            events.append({"ph": "X", "name": name, "cat": "region", "pid": r["rank"],
                           "tid": below, "ts": (begun - r["offset"] - origin) * 1e6,
                           "dur": (ended - begun) * 1e6, "args": {}})
    starts = _starts(calls)
    for r, c, call in calls:
        start = call["started"] - r["offset"] - origin
        end = (call["finished"] if call["finished"] is not None else call["started"]) - \
            r["offset"] - origin
        events.append({
            "ph": "X", "name": call["collective"], "cat": call["algorithm"] or "",
            "pid": r["rank"], "tid": r["communicators"].index(c),
            "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6,
            "args": {"seq": call["seq"], "algorithm": call["algorithm"],
                     "bytes": call["bytes"], "count": call["count"], "dtype": call["dtype"],
                     "op": call["op"], "root": call["root"], "state": call["state"],
                     "queued_us": (call["started"] - call["issued"]) * 1e6,
                     **_waits(r, c, call, starts),
                     **({"error": call["error"]} if call["error"] else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "commlib.trace", "ranks": len(ranks)}}


def _key(c: dict, call: dict) -> tuple:
    """A call as every member of its communicator names it (recorder.identify)."""
    return tuple(c.get("members", ())), c.get("ordinal", 0), call["seq"]


def _starts(calls: list) -> dict:
    """When each rank started each call, on rank 0's clock: {call's key: {rank: start}}."""
    starts: dict = {}
    for r, c, call in calls:
        starts.setdefault(_key(c, call), {})[r["rank"]] = call["started"] - r["offset"]
    return starts


def _waits(r: dict, c: dict, call: dict, starts: dict) -> dict:
    """Whom this rank waited for in ``call`` and how long: a collective cannot end here
    before every member has started it, so a peer that started later held it up by the
    difference (the last of them: waited_for, waited_us; the latest 8: late_peers). Empty
    where not every member's trace is at hand."""
    seen = starts[_key(c, call)]
    if not c.get("members") or set(seen) != set(c["members"]):
        return {}
    mine = seen[r["rank"]]
    late = sorted(((t - mine, peer) for peer, t in seen.items() if t > mine), reverse=True)
    if not late:
        return {"waited_us": 0.0}
    return {"waited_us": late[0][0] * 1e6, "waited_for": late[0][1],
            "late_peers": {str(peer): lag * 1e6 for lag, peer in late[:8]}}


def swimlanes(ranks: list[dict], trace: dict, path: str) -> None:
    """A PNG of ``trace`` (``ranks``' Chrome trace): a lane per rank, a bar per call
    coloured by collective, and under it the program's regions (forward, backward, ...) in
    lighter colours."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    calls = sorted({e["name"] for e in bars if e["cat"] != "region"})
    regions = sorted({e["name"] for e in bars if e["cat"] == "region"})
    colours = {**{n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(calls)},
               **{n: plt.get_cmap("Pastel2")(i % 8) for i, n in enumerate(regions)}}
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.6 * len(ranks)))
    for e in bars:
        lane = (e["pid"] + 0.1, 0.3) if e["cat"] == "region" else (e["pid"] - 0.4, 0.45)
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], lane,
                       color=colours[e["name"]])
    ax.set_yticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in calls + regions],
              labels=calls + regions, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlib.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="+", help="the COMMLIB_TRACE directory of a run (or each "
                   "host's, where they share no file system)")
    p.add_argument("-o", "--output", default="trace.json", help="the Chrome trace to write")
    p.add_argument("--png", help="also draw the swimlanes to this PNG (needs matplotlib)")
    p.add_argument("--window", metavar="FIRST,LAST",
                   help="keep only what overlaps these milliseconds (of the merged clock)")
    args = p.parse_args(argv)
    try:
        ranks = load(args.dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trace = chrome_trace(ranks)
    if args.window:
        try:
            first, last = (float(v) for v in args.window.split(","))
        except ValueError:
            p.error(f"--window {args.window!r}: give two numbers of milliseconds, FIRST,LAST")
        trace = cropped(trace, first, last)
    Path(args.output).write_text(json.dumps(trace))
    calls = sum(e["ph"] == "X" and e["cat"] != "region" for e in trace["traceEvents"])
    print(f"{args.output}: {calls} calls of {len(ranks)} ranks; open it in ui.perfetto.dev")
    if args.png:
        swimlanes(ranks, trace, args.png)
        print(f"{args.png}: swimlanes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
