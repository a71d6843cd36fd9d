"""Ranks that disagree on shared memory fail on every rank instead of hanging or
exchanging wrong data; the communicator then refuses work, and a new one works. Only a
transfer of the wrong size inside a schedule is recoverable (as under MPI): the receiver
raises, and the communicator goes on.

Usage: mpiexec -n N python tests/mpi/shm_errors.py   (N >= 2)
"""
import numpy as np

import commlib
from harness import Checker, assert_equal, raises

world = commlib.init()
n, rank = world.size, world.rank
check = Checker()


def mismatch(algorithm, collective="all_reduce"):
    def case():
        comm = world.dup()
        assert comm.transport == "shm"
        count = 10 + (rank == n - 1)  # the last rank disagrees about the count
        if collective == "all_reduce":
            call = lambda: comm.all_reduce(np.ones(count), algorithm=algorithm)  # noqa: E731
        else:
            call = lambda: comm.all_gather(np.ones(n * count), np.ones(count),  # noqa: E731
                                           algorithm=algorithm)
        raises(commlib.CommError, "", call)
        raises(commlib.CommError, "unusable", lambda: comm.all_reduce(np.ones(4)))
        comm.free()
        fresh = world.dup()  # a new communicator over the same ranks is fine
        t = np.ones(5)
        fresh.all_reduce(t, algorithm=algorithm)
        assert_equal(t, np.full(5, float(n)))
        fresh.free()
    return case


def different_collectives():
    comm = world.dup()
    t = np.ones(8)
    try:
        comm.broadcast(t) if rank == 0 else comm.all_reduce(t)
    except commlib.CommError as e:
        message = str(e)
    else:
        raise AssertionError("no CommError")
    # each rank raises; at least one names the cause (the others may see a failed peer first)
    assert any("different collective" in m for m in world.mpi.allgather(message))


def uneven_all_to_all_splits_disagree():
    comm = world.dup()
    send = [2] * n
    recv = [2] * n
    if rank == 0:
        recv[1] = 1  # rank 0 expects 1 element from rank 1, which sends 2
    out = np.zeros(sum(recv))
    call = lambda: comm.all_to_all(out, np.ones(sum(send)), recv, send)  # noqa: E731
    if rank == 0:  # the receiver raises; the data was drained, so the channels stay in step
        raises(commlib.CommError, "disagree on counts or splits", call)
    else:
        call()
    t = np.ones(3)  # ... and the communicator still works, as under MPI
    comm.all_reduce(t, algorithm="ring")
    assert_equal(t, np.full(3, float(n)))


def no_segment_in_dev_shm():
    from pathlib import Path
    comm = world.dup()
    comm.all_reduce(np.ones(3))
    mine = [p for p in Path("/dev/shm").glob("commlib-*")]
    assert not mine, f"segments left linked after set-up: {mine}"


for algo in ("direct", "ring"):
    check.check(f"count mismatch {algo}", mismatch(algo))
check.check("count mismatch all_gather direct", mismatch("direct", "all_gather"))
check.check("different collectives", different_collectives)
check.check("all_to_all splits disagree", uneven_all_to_all_splits_disagree)
check.check("no segment in /dev/shm", no_segment_in_dev_shm)
check.finish()
