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
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .comm import init
from .recorder import busy_seconds as recorder_busy, keep_calls as recorder_keep_calls
from .timeline import chrome_trace, cropped, load, swimlanes  # noqa: F401 (the public API)
from .tracer import begin_window, current, end_window, region  # noqa: F401 (the public API)
from .work import own_cpu_seconds as work_own_cpu_seconds


@contextmanager
def tracing(where):
    """Trace every communicator's calls issued inside, as COMMLIB_TRACE traces a whole run:
    collective over the world (every rank enters and leaves it); at the exit each rank writes
    ``where/rank-NNNNN.json`` for ``python -m commlib.trace where`` to merge. Meanwhile the
    recorders keep COMMLIB_TRACE_CALLS calls (100000), then their usual number again."""
    tracer = begin_window(Path(where), init(), since=time.monotonic())
    try:
        yield tracer
    finally:
        end_window(tracer)


# ---------------------------------------------------------------------------- a step's time
def busy_seconds(since: float, until: float) -> float:
    """Seconds within [since, until] (time.monotonic's clock) during which some call of
    this process was running, on any communicator (recorder.busy_seconds): a step's
    communication, beside its compute (own_cpu_seconds)."""
    return recorder_busy(since, until)


keep_calls = recorder_keep_calls  # every recorder keeps at least N calls (for busy_seconds)
own_cpu_seconds = work_own_cpu_seconds  # CPU seconds of commlib's own threads so far


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
