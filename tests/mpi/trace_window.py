"""commlib.trace.tracing: a window of a run (no COMMLIB_TRACE), merged by rank 0. It holds
exactly the calls issued inside, of communicators made before and inside it, past what a
flight recorder keeps outside one; and who waited for whom. Usage: mpiexec -n 3 python
tests/mpi/trace_window.py DIR"""
import sys
import time
from pathlib import Path

import numpy as np

import commlib
from commlib import trace
from harness import Checker, raises

world = commlib.init()
n, rank = world.size, world.rank
where = Path(sys.argv[1])
check = Checker()
x = np.ones(100, np.float32)
half = world.split(rank % 2)
for _ in range(5):
    world.all_reduce(x)  # before: not in the window
with trace.tracing(where) as tracer:
    raises(RuntimeError, "already tracing", lambda: trace.tracing(where).__enter__())
    for _ in range(100):  # more than the flight recorder's 64 (on the C++ fast path)
        world.all_reduce(x)
    half.all_reduce(np.ones(10))
    dup = world.dup()
    if rank == n - 1:
        time.sleep(0.2)  # the others wait for the last rank
    dup.all_reduce(np.ones(1 << 16, np.float32), algorithm="ring")
world.all_reduce(x)  # after: not in it either
world.barrier()


def merged():
    ranks = trace.load(where)
    events = [e for e in trace.chrome_trace(ranks)["traceEvents"] if e["ph"] == "X"]
    for r in range(n):
        mine = [e for e in events if e["pid"] == r]
        assert [e["name"] for e in mine].count("all_reduce") == 102, len(mine)
        assert len({e["tid"] for e in mine}) == 3  # world, half, dup
    late = [e for e in events if e["args"]["bytes"] == 1 << 18]
    assert len(late) == n
    for e in late:
        if e["pid"] == n - 1:
            assert e["args"]["waited_us"] < 50e3, e["args"]
        else:  # (the clocks agree within a few ms on one host)
            assert e["args"]["waited_for"] == n - 1 and e["args"]["waited_us"] > 150e3, e
            assert set(e["args"]["late_peers"]) >= {str(n - 1)}


def restored():
    assert trace.current() is None and tracer.since is not None
    assert world._calls.recorder.calls.maxlen == 64
    for _ in range(70):
        world.all_reduce(x)
    assert len(world.flight_record()) == 64


if rank == 0 and n > 1:
    check.check("merged", merged)
check.check("recorders restored", restored)
check.finish()
