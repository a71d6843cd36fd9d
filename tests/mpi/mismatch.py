"""Ranks that disagree about a collective: every rank raises CollectiveMismatchError naming
what differs and which ranks called what, within seconds, on whatever transport this
launch uses (COMMLIB_TRANSPORT / COMMLIB_RANKS_PER_HOST). The last rank disagrees: in
CASES by a valid call of its own, in INVALID_CASES by arguments that only it gets wrong
(it raises ValueError/TypeError, its peers CollectiveMismatchError naming it).

Usage: mpiexec -n N python tests/mpi/mismatch.py   (N >= 2; prints the figures on rank 0)
"""
import time

import numpy as np

import commlib
from harness import Checker

world = commlib.init()
n, rank = world.size, world.rank
odd = rank == n - 1  # the rank that disagrees
check = Checker()
detected, tried, seconds = 0, 0, []


def ones(count, dtype="float64"):
    return np.ones(count, dtype)


def all_to_all_splits(comm):
    # rank 0 expects one element more from the last rank than the last rank sends it
    isplits, osplits = [2] * n, [2] * n
    if rank == 0:
        osplits[n - 1] = 3
    comm.all_to_all(np.zeros(sum(osplits)), ones(sum(isplits)), osplits, isplits)


def two_algorithms(comm, collective):
    names = [a for a in comm.algorithms(collective) if a != "hier"]
    return names[0], names[1]


# a user-defined op (commlib/user_ops.py), which the messages name
ABSMAX = commlib.ReduceOp.define(lambda a, b: max(abs(a), abs(b)), "float64", name="absmax")

CASES = {  # name: (what the message must name, the call each rank makes)
    "all_reduce count": ("count", lambda c: c.all_reduce(ones(10 + odd))),
    "all_reduce dtype": ("dtype", lambda c: c.all_reduce(ones(8, "float32" if odd else "float64"))),
    "all_reduce op": ("op", lambda c: c.all_reduce(ones(8), op="max" if odd else "sum")),
    "all_reduce sum vs avg": ("op", lambda c: c.all_reduce(ones(8), op="avg" if odd else "sum")),
    "all_reduce max vs user op": ("'absmax'", lambda c: c.all_reduce(
        ones(8), op=ABSMAX if odd else "max")),
    "all_reduce algorithm": ("algorithm", lambda c: c.all_reduce(
        ones(100), algorithm=two_algorithms(c, "all_reduce")[odd])),  # (eager runs 100)
    "reduce_scatter count": ("count", lambda c: c.reduce_scatter(ones(4 + odd),
                                                                 ones(n * (4 + odd)))),
    "reduce_scatter op": ("op", lambda c: c.reduce_scatter(ones(4), ones(4 * n),
                                                           op="min" if odd else "sum")),
    "all_gather count": ("count", lambda c: c.all_gather(ones(n * (3 + odd)), ones(3 + odd))),
    "all_gather dtype": ("dtype", lambda c: c.all_gather(
        ones(4 * n, "int32" if odd else "float32"), ones(4, "int32" if odd else "float32"))),
    "broadcast root": ("root", lambda c: c.broadcast(ones(6), root=1 if odd else 0)),
    "broadcast count": ("count", lambda c: c.broadcast(ones(6 + odd))),
    "reduce root": ("root", lambda c: c.reduce(ones(6), root=1 if odd else 0)),
    "reduce op": ("op", lambda c: c.reduce(ones(6), op="prod" if odd else "sum")),
    "all_to_all splits": ("splits", all_to_all_splits),
    "all_reduce vs broadcast": ("collective", lambda c: c.broadcast(ones(8)) if odd
                                else c.all_reduce(ones(8))),
    "barrier vs all_reduce": ("collective", lambda c: c.barrier() if odd
                              else c.all_reduce(ones(8))),
    "all_gather vs all_to_all": ("collective", lambda c: c.all_to_all(ones(2 * n), ones(2 * n))
                                 if odd else c.all_gather(ones(2 * n), ones(2))),
    # schedules with large, segmented transfers: the disagreeing rank's would be longer,
    # shorter or of another collective
    "ring all_reduce count, moving": ("count", lambda c: c.all_reduce(
        ones(300_000 + 7 * odd), algorithm="ring")),
    "ring vs tree, moving": ("algorithm", lambda c: c.all_reduce(
        ones(300_000), algorithm="tree" if odd else "ring")),
    # rooted plans: a leaf's or the root's part ends without meeting every peer; after warm
    # calls, which a fast path could have learned
    "tree reduce root, warm": ("root", lambda c: [c.reduce(ones(6), algorithm="tree")
                                                  for _ in range(3)] and c.reduce(
        ones(6), root=1 if odd else 0, algorithm="tree")),
    "ring broadcast count, warm": ("count", lambda c: [c.broadcast(ones(6), algorithm="ring")
                                                       for _ in range(3)] and c.broadcast(
        ones(6 + odd), algorithm="ring")),
    "ring all_gather vs reduce_scatter, moving": ("collective", lambda c: c.reduce_scatter(
        ones(50_000), ones(50_000 * n), algorithm="ring") if odd else c.all_gather(
        ones(50_000 * n), ones(50_000), algorithm="ring")),
}

INVALID_CASES = {  # arguments valid on every rank but the last
    "all_reduce of a list": lambda c: c.all_reduce([1.0] * 8 if odd else ones(8)),
    "reduce_scatter in place on the wrong block": lambda c: (
        lambda x: c.reduce_scatter(x[:4] if odd else np.empty(4), x))(ones(4 * n)),
    "all_gather output of the wrong size": lambda c: c.all_gather(ones(3 * n + odd), ones(3)),
    "all_to_all with overlapping buffers": lambda c: (
        lambda x: c.all_to_all(x if odd else np.empty(2 * n), x))(ones(2 * n)),
    "broadcast root outside": lambda c: c.broadcast(ones(6), root=n if odd else 0),
    "reduce op unknown": lambda c: c.reduce(ones(6), op="bogus" if odd else "sum"),
    "user op on a dtype it lacks": lambda c: c.all_reduce(ones(8, "float32" if odd else
                                                               "float64"), op=ABSMAX),
    "barrier timeout negative": lambda c: c.barrier(timeout=-1 if odd else None),
}


def case(name, field, call, invalid=False):
    def run():
        global detected, tried
        comm = world.dup()
        comm.timeout = 20  # a missed mismatch becomes a timeout, not a hang
        start = time.monotonic()
        try:
            call(comm)
            outcome = "returned"
        except commlib.CollectiveMismatchError as e:
            outcome = str(e)
        except (commlib.CommError, ValueError, TypeError) as e:
            outcome = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        outcomes = world.mpi.allgather(outcome)
        tried += 1
        seconds.append(max(world.mpi.allgather(took)))
        valid = outcomes[:-1] if invalid else outcomes
        fine = all(o.startswith("collective #") and "match" in o for o in valid)
        if invalid:
            fine = fine and outcomes[-1].startswith(("ValueError", "TypeError"))
        detected += fine
        assert fine, f"not every rank raised CollectiveMismatchError (or its own error): {outcomes}"
        if not (invalid and odd):
            mine = outcomes[rank]
            assert field in mine and f"rank {n - 1}" in mine, \
                f"{field!r} or rank {n - 1} not named: {mine}"
        comm.free()
    return run


def goes_on_after_disagreeing():
    """A disagreement the check finds leaves the communicator usable (over TCP a call's
    first data go out behind its row, crossing the peers' rows, and are dropped where the
    ranks disagree): on the same communicator, the next calls give the right results,
    after disagreements whose data fill the sockets many times over."""
    comm = world.dup()
    comm.timeout = 20
    for count in (300_000, 3_000_000):  # (2.4 and 24 MB)
        for algorithm in ("ring", "rhd"):
            try:
                comm.all_reduce(ones(count + 7 * odd), algorithm=algorithm)
                raise AssertionError(f"{algorithm} all_reduce of different counts returned")
            except commlib.CollectiveMismatchError as e:
                assert "count" in str(e), e
            x = np.full(count, rank + 1.0)
            comm.all_reduce(x, algorithm=algorithm)
            assert (x == n * (n + 1) / 2).all(), (algorithm, count, x[:4])
        parts = count // n
        try:  # every part of the disagreeing rank one element longer
            comm.all_to_all(np.zeros(n * parts), ones(n * (parts + odd)))
            raise AssertionError("all_to_all of different counts returned")
        except commlib.CollectiveMismatchError:
            pass
        got = np.zeros(n * parts)
        comm.all_to_all(got, np.repeat(np.arange(n, dtype=np.float64) + 10 * rank, parts))
        assert (got == np.repeat(10 * np.arange(n) + rank, parts)).all(), got[::parts]
    comm.free()


if n >= 2:
    transport = world.dup().transport
    for name, (field, call) in CASES.items():
        check.check(name, case(name, field, call))
    for name, call in INVALID_CASES.items():
        check.check(name, case(name, "invalid", call, invalid=True))
    if transport != "shm":  # (on shared memory a disagreement found mid-call ends it)
        check.check("goes on after disagreeing", goes_on_after_disagreeing)
    if rank == 0:
        print(f"mismatch figures ({transport}, {n} ranks): {tried} cases, {detected} raised "
              f"on every rank (CollectiveMismatchError, or an invalid rank's own error); time "
              f"to detection median {np.median(seconds) * 1e3:.1f} ms, max "
              f"{max(seconds) * 1e3:.1f} ms", flush=True)
check.finish()
