"""Every blocking wait is bounded: a collective or receive that a peer never joins raises
CommTimeoutError naming the call, its sequence number and the peer; the communicator is
then unusable (its peers are somewhere inside the call); the flight recorder shows it.

Usage: mpiexec -n N python tests/mpi/timeouts.py   (N >= 2)
"""
import os
import time

import numpy as np

import commlib
from harness import Checker, assert_equal, raises

world = commlib.init()
n, rank = world.size, world.rank
check = Checker()


def timed(fn):
    start = time.monotonic()
    try:
        fn()
    except commlib.CommError as e:
        return e, time.monotonic() - start
    return None, time.monotonic() - start


def collective_that_a_peer_never_joins():
    comm = world.dup()
    comm.all_reduce(np.ones(3))  # collective #1 completes
    try:
        if rank == 0:
            # (beyond eager's 1 MiB: its data would reach the peers with its descriptor, and
            # they could finish the call without rank 0)
            error, took = timed(lambda: comm.all_reduce(np.ones(300_000), timeout=0.5))
            assert isinstance(error, commlib.CommTimeoutError), repr(error)
            assert 0.45 <= took < 5, took
            message = str(error)
            for part in ("collective #2", "all_reduce", "waiting for"):
                assert part in message, f"{part!r} not in {message}"
            assert any(f"rank {peer}" in message for peer in range(1, n)), message
            # every rank, though outside any call of commlib's (in MPI's barrier, on other
            # hosts too), answers for the failure's timeline
            (note,) = [note for note in error.__notes__ if "last calls" in note]
            assert f"the last calls of the {n} of {n} ranks that answered" in note, note
            last = comm.flight_record()[-1]
            assert (last["seq"], last["state"], last["collective"]) == (2, "failed",
                                                                          "all_reduce"), last
            assert "CommTimeoutError" in last["error"], last
            assert comm.flight_record()[-2]["state"] == "done"
            raises(commlib.CommError, "unusable", lambda: comm.all_reduce(np.ones(3)))
    finally:
        world.mpi.Barrier()  # the peers join only now: they fail too, within their timeout
    if rank != 0:
        error, took = timed(lambda: comm.all_reduce(np.ones(100_000), timeout=1))
        assert isinstance(error, commlib.CommError) and took < 5, (error, took)


def receive_that_never_arrives():
    src, dst = (rank + 1) % n, (rank - 1) % n
    try:
        error, took = timed(lambda: world.recv(np.zeros(4), src, tag=11, timeout=0.3))
        assert isinstance(error, commlib.CommTimeoutError) and f"rank {src}" in str(error), error
        assert 0.25 <= took < 5, took
        work = world.recv(np.zeros(4), src, tag=12, async_op=True, timeout=0.3)
        error, took = timed(work.wait)
        assert isinstance(error, commlib.CommTimeoutError), repr(error)
        assert took < 5, took
    finally:
        world.mpi.Barrier()
    # the abandoned receives were cancelled: later messages with those tags land normally
    for tag in (11, 12):
        got = np.zeros(4)
        sent = np.full(4, float(rank + tag))
        w = world.send(sent, dst, tag=tag, async_op=True)
        world.recv(got, src, tag=tag)
        w.wait()
        assert_equal(got, np.full(4, float(src + tag)))


def default_from_the_environment():
    os.environ["COMMLIB_TIMEOUT"] = "0.4"
    try:
        comm = world.dup()
    finally:
        del os.environ["COMMLIB_TIMEOUT"]
    assert comm.timeout == 0.4, comm.timeout
    try:
        if rank == 0:
            error, took = timed(comm.barrier)
            assert isinstance(error, commlib.CommTimeoutError), repr(error)
            assert "barrier" in str(error) and 0.35 <= took < 5, (error, took)
    finally:
        world.mpi.Barrier()


def bad_timeouts_are_refused():
    for bad in (-1, "1", float("nan"), True):
        raises(ValueError, "timeout", lambda: world.all_reduce(np.ones(2), timeout=bad))
    raises(ValueError, "timeout", lambda: setattr(world, "timeout", -3))


def flight_recorder_keeps_the_last_calls():
    comm = world.dup()
    comm.all_reduce(np.ones(5, np.float32))
    comm.broadcast(np.ones(3), root=n - 1)
    comm.barrier()
    records = comm.flight_record()
    assert [(r["seq"], r["collective"], r["state"]) for r in records] == [
        (1, "all_reduce", "done"), (2, "broadcast", "done"), (3, "barrier", "done")], records
    assert records[0]["count"] == 5 and records[0]["dtype"] == "float32", records[0]
    assert records[1]["root"] == n - 1
    assert all(r["issued"] <= r["started"] <= r["finished"] for r in records), records
    import io
    text = comm._calls.recorder.dump(io.StringIO())  # (what a timeout prints)
    assert "broadcast" in text and "done" in text, text
    comm.free()


if n >= 2:
    check.run_cases(globals())
check.finish()
