"""Asynchronous collectives and point-to-point: issue order, independence of communicators,
background progress, errors through wait(), under mpiexec."""
import time

import numpy as np

import commlib
from harness import Checker, assert_equal, torch

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
WAIT = 60  # seconds; a hang fails the case instead of the job


def every_collective_async():
    t = np.full(1001, rank + 1.0)
    w = comm.all_reduce(t, async_op=True)
    assert isinstance(w, commlib.Work)
    assert w.wait(WAIT) is True and w.result is t and w.exception() is None
    assert_equal(t, np.full(1001, n * (n + 1) / 2))
    out, inp = np.zeros(3), np.full(3 * n, float(rank))
    works = [comm.reduce_scatter(out, inp, op="max", async_op=True),
             comm.broadcast(b := np.full(5, float(rank)), root=n - 1, async_op=True),
             comm.reduce(r := np.full(4, 2.0), root=0, op="prod", async_op=True),
             comm.all_gather(g := np.zeros(2 * n), np.full(2, float(rank)), async_op=True),
             comm.all_to_all(a := np.zeros(n), np.arange(n, dtype=float) + 10 * rank,
                             async_op=True),
             comm.barrier(async_op=True)]
    commlib.wait_all(works, timeout=WAIT)
    assert all(w.is_completed() for w in works)
    assert_equal(out, np.full(3, n - 1.0))
    assert_equal(b, np.full(5, n - 1.0))
    assert_equal(r, np.full(4, 2.0 ** n) if rank == 0 else np.full(4, 2.0))
    assert_equal(g, np.repeat(np.arange(n, dtype=float), 2))
    assert_equal(a, np.arange(n) * 10.0 + rank)


def issue_order_on_one_communicator():
    """Each op reads what the one before it wrote: only issue order gives the right answer."""
    t = np.full(200_003, 1.0)  # > 1 segment with the ring, so pipelining runs in the engine
    order = []
    works = []
    for i, algo in enumerate(["ring", "rhd", "tree", "native", "ring"]):
        w = comm.all_reduce(t, algorithm=algo, async_op=True)
        w.add_done_callback(lambda w, i=i: order.append(i))
        works.append(w)
    comm.all_reduce(t, algorithm="ring")  # a blocking call queues behind them
    commlib.wait_all(works, timeout=WAIT)
    assert order == [0, 1, 2, 3, 4], order
    assert_equal(t, np.full(200_003, float(n) ** 6))


def communicators_progress_independently():
    """Rank 0 issues on A then B, the others B then A, and everyone waits for B first: if
    communicators shared one queue, rank 0's B would sit behind an A nobody else has issued."""
    a, b = comm.dup(), comm.dup()
    x, y = np.ones(10), np.ones(10)
    if rank == 0:
        wa = a.all_reduce(x, async_op=True)
        time.sleep(0.2)  # A is surely first in line here
        wb = b.all_reduce(y, async_op=True)
    else:
        wb = b.all_reduce(y, async_op=True)
        wb.wait(WAIT)
        wa = a.all_reduce(x, async_op=True)
    wb.wait(WAIT)
    wa.wait(WAIT)
    assert_equal(x, np.full(10, float(n)))
    assert_equal(y, np.full(10, float(n)))
    a.free()
    b.free()


def progress_while_the_caller_sleeps():
    """Nobody calls into commlib or MPI after issuing, yet the collective completes."""
    t = np.ones(1 << 18)
    comm.barrier()
    w = comm.all_reduce(t, algorithm="ring", async_op=True)
    deadline = time.monotonic() + WAIT
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert w.is_completed(), "no background progress"
    assert_equal(t, np.full(1 << 18, float(n)))


def point_to_point_async():
    if n < 2:
        return
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    big = np.full(1 << 20, float(rank))  # rendezvous size: blocking sends would deadlock
    got = np.empty_like(big)
    ws = [comm.send(big, nxt, tag=1, async_op=True), comm.recv(got, prev, tag=1, async_op=True)]
    commlib.wait_all(ws, timeout=WAIT)
    assert ws[1].result is got
    assert_equal(got, np.full(1 << 20, float(prev)))
    # from any source: the Work says which rank sent
    if rank != 0:
        comm.send(np.full(4, float(rank)), 0, tag=3)
    else:
        sources = set()
        for _ in range(n - 1):
            w = comm.recv(buf := np.zeros(4), None, tag=3, async_op=True)
            w.wait(WAIT)
            assert_equal(buf, np.full(4, float(w.source)))
            sources.add(w.source)
        assert sources == set(range(1, n)), sources
    # a message shorter than the tensor is reported by wait()
    if rank == 0:
        comm.send(np.zeros(2), 1, tag=2, async_op=True).wait(WAIT)
    if rank == 1:
        w = comm.recv(np.zeros(3), 0, tag=2, async_op=True)
        try:
            w.wait(WAIT)
            raise AssertionError("short message accepted")
        except commlib.CommError as e:
            assert "16 bytes" in str(e) and isinstance(w.exception(), commlib.CommError)


def errors_surface_through_wait():
    """Ranks that disagree on all_to_all splits: every rank's wait() raises."""
    if n < 2:
        return
    # rank 0 sends 1 element to rank 1, which expects 2
    isplits = [1] * n
    osplits = [2 if (rank == 1 and src == 0) else 1 for src in range(n)]
    w = comm.all_to_all(np.zeros(sum(osplits)), np.zeros(n), osplits, isplits,
                        algorithm="pairwise", async_op=True)
    try:
        w.wait(WAIT)
        raise AssertionError("mismatch not detected")
    except commlib.CollectiveMismatchError as e:
        assert "rank 0 sends 1 elements to rank 1, which expects 2" in str(e), e
    comm.barrier()
    t = np.ones(3)  # the communicator still works afterwards
    comm.all_reduce(t)
    assert_equal(t, np.full(3, float(n)))


def wait_timeout_and_validation():
    if n < 2:
        return
    w = comm.recv(np.zeros(1), (rank + 1) % n, tag=9, async_op=True)
    try:
        w.wait(0.05)
        raise AssertionError("no timeout")
    except commlib.CommTimeoutError as e:
        assert "recv from rank" in str(e)
    comm.barrier()  # every rank has timed out: only now is the message sent
    comm.send(np.zeros(1), (rank - 1) % n, tag=9)
    w.wait(WAIT)
    try:  # validation still raises at the call, nothing is queued
        comm.all_reduce(np.zeros(3, np.int32), op="avg", async_op=True)
        raise AssertionError("accepted")
    except ValueError:
        pass


def torch_tensors_async():
    if torch is None:
        return
    x = torch.full((64, 3), float(rank), dtype=torch.bfloat16)
    comm.all_reduce(x, op="max", async_op=True).wait(WAIT)
    assert bool((x == n - 1).all())


check.run_cases(globals())
