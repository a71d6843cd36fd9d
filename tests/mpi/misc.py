"""Sub-communicators concurrent with the world, point-to-point, barrier, module functions,
algorithm selection, fp16/bf16 accuracy, argument errors, and a world freed and made anew,
under mpiexec."""
import os
import threading
import time

import numpy as np

import commlib
from commlib.select import choose
from harness import Checker, assert_equal, raises, torch

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()


def concurrent_subcommunicators():
    sub = comm.split(rank % 2, key=-rank)  # reversed order inside each half
    members = [r for r in range(n) if r % 2 == rank % 2]
    assert sub.size == len(members) and sub.rank == sorted(members, reverse=True).index(rank)
    twin = comm.dup()
    errors = []

    def loop(c, algo, expected):
        try:
            for i in range(30):
                t = np.full(1000 + i, float(rank + i))
                c.all_reduce(t, algorithm=algo)
                assert_equal(t, np.full(1000 + i, expected(i)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=loop,
                                args=(sub, "ring", lambda i: sum(members) + i * len(members))),
               threading.Thread(target=loop, args=(comm, "rhd", lambda i: n * (n - 1) / 2 + i * n)),
               threading.Thread(target=loop,
                                args=(twin, "native", lambda i: n * (n - 1) / 2 + i * n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert comm.split(None) is None  # opting out gives None
    for c in (sub, twin):
        c.free()


def point_to_point():
    if n < 2:
        return
    t = np.arange(5, dtype=np.int32) + rank
    got = np.empty(5, np.int32)
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        comm.send(t, nxt, tag=3)
        comm.recv(got, prev, tag=3)
    else:
        comm.recv(got, prev, tag=3)
        comm.send(t, nxt, tag=3)
    assert_equal(got, np.arange(5, dtype=np.int32) + prev)
    # a message that does not fill the tensor is an error, not silent stale data
    if rank == 0:
        comm.send(np.zeros(3, np.int32), 1, tag=4)
    if rank == 1:
        try:
            comm.recv(np.zeros(5, np.int32), 0, tag=4)
            raise AssertionError("short message accepted")
        except commlib.CommError as e:
            assert "12 bytes" in str(e)


def any_shape():
    t = np.full((3, 4, 5), float(rank + 1), np.float32)
    comm.all_reduce(t, algorithm="ring")
    assert_equal(t, np.full((3, 4, 5), n * (n + 1) / 2, np.float32))
    if torch is not None:
        x = torch.full((2, 3), rank, dtype=torch.int64)[1]  # a contiguous view with an offset
        comm.all_reduce(x, op="max", algorithm="tree")
        assert x.tolist() == [n - 1] * 3


def module_functions_and_barrier():
    t = np.ones(7)
    assert commlib.all_reduce(t) is t
    assert_equal(t, np.full(7, float(n)))
    out = np.empty(3 * n)
    commlib.all_gather(out, np.full(3, float(rank)))
    assert_equal(out, np.repeat(np.arange(n, dtype=float), 3))
    commlib.barrier()
    b = np.full(4, float(rank))
    commlib.broadcast(b, root=n - 1, comm=comm)
    assert_equal(b, np.full(4, float(n - 1)))


def selection():
    os.environ["COMMLIB_ALGO_ALL_REDUCE"] = "tree"
    try:
        assert choose("all_reduce", None, n, 1 << 20).name == "tree"
        assert choose("all_reduce", "ring", n, 8).name == "ring"  # the argument wins
        # a communicator reads the overrides when it is created (as NCCL reads its env at init)
        tree = comm.dup()
        t = np.ones(11)
        tree.all_reduce(t)
        assert tree.flight_record()[-1]["algorithm"] == "tree"
        assert_equal(t, np.full(11, float(n)))
        comm.all_reduce(np.ones(11))
        assert comm.flight_record()[-1]["algorithm"] != "tree" or n == 1
        os.environ["COMMLIB_ALGO_ALL_REDUCE"] = "bogus"
        bogus = comm.dup()
        try:
            bogus.all_reduce(t)
            raise AssertionError("unknown algorithm accepted")
        except ValueError as e:
            assert ", ".join(comm.algorithms("all_reduce")) in str(e)
        for c in (tree, bogus):
            c.free()
    finally:
        del os.environ["COMMLIB_ALGO_ALL_REDUCE"]
    assert choose("all_reduce", None, n, 1 << 20, transport=comm.transport).name in \
        comm.algorithms("all_reduce")


def half_precision_accuracy():
    """Random fp16/bf16 values reduce with fp32 arithmetic: compare to float64 within tolerance."""
    if torch is None:
        return
    rng = np.random.default_rng(rank)
    for dtype, tol in ((torch.float16, 5e-3), (torch.bfloat16, 4e-2)):
        for algo in comm.algorithms("all_reduce"):
            x = torch.tensor(rng.standard_normal(10_001), dtype=dtype)
            mine = x.to(torch.float64).numpy()
            want = comm.mpi.allreduce(mine)  # float64 reference, by MPI itself
            comm.all_reduce(x, algorithm=algo)
            err = np.abs(x.to(torch.float64).numpy() - want).max()
            assert err <= tol * max(1.0, np.abs(want).max()), f"{dtype} {algo}: max error {err}"


def errors_before_communication():
    """Bad arguments raise on every rank, before anything is sent (so nothing hangs)."""
    a = np.zeros((4, 4))
    raises(ValueError, "contiguous", lambda: comm.all_reduce(a[:, 1]))
    raises(TypeError, "not supported", lambda: comm.all_reduce(np.zeros(3, np.complex64)))
    raises(TypeError, "numpy array or a torch", lambda: comm.all_reduce([1, 2, 3]))
    raises(ValueError, "avg", lambda: comm.all_reduce(np.zeros(3, np.int32), op="avg"))
    raises(ValueError, "unknown reduce op", lambda: comm.all_reduce(np.zeros(3), op="xor"))
    raises(ValueError, "valid:", lambda: comm.all_reduce(np.zeros(3), algorithm="pairwise"))
    raises(ValueError, "outside", lambda: comm.broadcast(np.zeros(3), root=n))
    raises(ValueError, "expected", lambda: comm.reduce_scatter(np.zeros(2), np.zeros(2 * n + 1)))
    raises(ValueError, "expected", lambda: comm.all_gather(np.zeros(2 * n + 1), np.zeros(2)))
    raises(TypeError, "dtype", lambda: comm.all_gather(np.zeros(2 * n), np.zeros(2, np.float32)))
    buf = np.zeros(4 * n)
    raises(ValueError, "overlap", lambda: comm.reduce_scatter(buf[1:3], buf[:2 * n]))
    raises(ValueError, "overlap", lambda: comm.all_to_all(buf, buf))
    if n > 1:
        raises(ValueError, "divisible", lambda: comm.all_to_all(np.zeros(n + 1), np.zeros(n + 1)))
    raises(ValueError, "one per rank",
           lambda: comm.all_to_all(np.zeros(n), np.zeros(n), [1] * (n + 1)))
    raises(ValueError, "sum to", lambda: comm.all_to_all(np.zeros(n), np.zeros(n), [2] * n))
    raises(ValueError, "self", lambda: comm.send(np.zeros(1), rank))
    ro = np.zeros(3)
    ro.flags.writeable = False
    raises(ValueError, "read-only", lambda: comm.all_reduce(ro))
    if torch is not None:
        raises(ValueError, ".contiguous()", lambda: comm.all_reduce(torch.zeros(4, 4).t()))
        raises(TypeError, "bool", lambda: comm.all_reduce(torch.zeros(3, dtype=torch.bool)))
    comm.barrier()  # everyone is still in step


def bytes_sent_counts_what_each_algorithm_sends():
    """Communicator.bytes_sent: exact for schedules and direct reads (the run matrix covers
    the shm, mpi and virtual-host transports); a point-to-point send counts its bytes."""
    nbytes = 48_000  # divides by 1..4 ranks into whole float32 elements
    ring_and_direct = 2 * (n - 1) * nbytes // n  # per rank: a reduce-scatter and a gather
    for algo in [a for a in ("ring", "direct", "native") if a in comm.algorithms("all_reduce")]:
        before = comm.bytes_sent
        comm.all_reduce(np.ones(nbytes // 4, np.float32), algorithm=algo)
        assert comm.bytes_sent - before == ring_and_direct, (algo, comm.bytes_sent - before)
    before = comm.bytes_sent
    comm.all_gather(np.empty(nbytes // 4 * n, np.float32), np.ones(nbytes // 4, np.float32),
                    algorithm="ring")
    assert comm.bytes_sent - before == (n - 1) * nbytes
    if n > 1:
        before = comm.bytes_sent
        if rank == 0:
            comm.send(np.ones(10, np.int64), 1)
        elif rank == 1:
            comm.recv(np.empty(10, np.int64), 0)
        assert comm.bytes_sent - before == (80 if rank == 0 else 0)


def streaming_copies():
    """Received data land with streaming stores from the transport's streaming_from (8 MiB
    at least; where the host's ranks would fill half the cache): every collective and
    algorithm that copies received data, with every transfer streaming, gives what it
    gives without (odd sizes: the streaming copy's unaligned head and tail)."""
    shm = getattr(comm._transport, "shm", None)
    if shm is None:
        return
    default = shm.streaming_from
    assert default >= 8 << 20, default
    count = (1 << 20) // 4 + 3
    mine = np.arange(count, dtype=np.int32) + rank
    want = np.concatenate([np.arange(count, dtype=np.int32) + r for r in range(n)])
    shared = comm.empty(count, np.int32)  # (one_copy reads it through the mapping)
    shared[:] = mine
    try:
        shm.streaming_from = 0
        for algo in comm.algorithms("all_gather"):
            for source in (mine, shared):
                out = np.zeros(n * count, np.int32)
                comm.all_gather(out, source, algorithm=algo)
                assert_equal(out, want)
        for algo in comm.algorithms("all_reduce"):
            total = mine.astype(np.float32)
            comm.all_reduce(total, algorithm=algo)
            assert_equal(total, (np.arange(count) * n + n * (n - 1) // 2).astype(np.float32))
        for algo in comm.algorithms("broadcast"):
            got = mine.copy()
            comm.broadcast(got, root=n - 1, algorithm=algo)
            assert_equal(got, np.arange(count, dtype=np.int32) + n - 1)
        a2a_out = np.zeros(n * count, np.int32)
        comm.all_to_all(a2a_out, np.tile(mine, n))
        assert_equal(a2a_out, want)
    finally:
        shm.streaming_from = default


def finalize_frees_the_world_and_init_makes_a_new_one():  # (last: the cases above use it)
    global comm
    commlib.finalize()
    raises(commlib.CommError, "freed", lambda: comm.all_reduce(np.ones(3)))
    deadline = time.monotonic() + 5  # the job's responder (commlib/responder.py) ends too
    while any(t.name == "commlib-responder" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the responder outlived its world"
        time.sleep(0.01)
    old, comm = comm, commlib.init()
    assert comm is not old and commlib.init() is comm
    t = np.ones(3)
    comm.all_reduce(t)
    assert_equal(t, np.full(3, float(n)))


check.run_cases(globals())
