"""The fast path (commlib/fast_path.py): numpy calls after the first of their kind run in
one C++ call; results, declines, mixed paths across ranks, errors and the flight record.
On shared memory every algorithm but MPI's own runs there; on the mpi transport
(COMMLIB_TRANSPORT=mpi), eager does, and MPI's own (but for reductions of 16-bit floats,
which MPI cannot reduce itself)."""
import gc
import os
import weakref

import numpy as np
from mpi4py import MPI

import commlib
from commlib.buffers import as_buffer
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError
from harness import Checker, assert_equal, raises, torch

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
fast = comm._calls.fast.native  # (white-box: which path a call took)
ON_MPI = comm._transport.name == "mpi"


def _runs_fast(record: dict) -> bool:
    """Whether the call of flight-record row ``record`` runs on the fast path."""
    algorithm = record["algorithm"]
    if ON_MPI:  # (MPI reduces 16-bit floats through an op Python made)
        reduces_halves = record["op"] is not None and record["dtype"] in ("float16", "bfloat16")
        return algorithm == "eager" or (algorithm == "native" and not reduces_halves)
    return algorithm not in ("native", "ordered")  # (ordered: made of other collectives)


def _twice(call) -> None:
    """``call()`` (which checks its own result) twice: the first call of its kind may take
    the general path (unless an earlier call with another op or dtype of the same size
    taught the fast path), the second must take the fast one if it runs there."""
    call()
    before = fast.taken
    call()
    record = comm.flight_record()[-1]
    assert fast.taken == before + _runs_fast(record), f"{record}: the general path"


def _cases():
    for count in (1, 5, 1000, 40_003):
        for dtype in ("float32", "float16", "int8", "int64"):
            yield count, dtype


def results_match_the_general_path():
    assert fast is not None, "shared memory, COMMLIB_FAST_PATH unset: the fast path is on"
    for count, dt in _cases():
        ranks = np.arange(n)

        def all_reduce(op, want):
            t = np.full(count, rank + 1, dt)
            comm.all_reduce(t, op=op)
            assert_equal(t, np.full(count, want, dt))
        _twice(lambda: all_reduce("sum", n * (n + 1) // 2))
        _twice(lambda: all_reduce("max", n))
        if dt.startswith("float"):
            _twice(lambda: all_reduce("avg", (n + 1) / 2))

        def all_gather():
            out = np.zeros(count * n, dt)
            comm.all_gather(out, np.full(count, rank, dt))
            assert_equal(out, np.repeat(ranks, count).astype(dt))
        _twice(all_gather)

        def reduce_scatter():
            out = np.zeros(count, dt)
            comm.reduce_scatter(out, np.repeat(ranks + rank, count).astype(dt))
            assert_equal(out, np.full(count, n * rank + n * (n - 1) // 2, dt))
        _twice(reduce_scatter)

        def all_to_all():
            out = np.zeros(count * n, dt)
            comm.all_to_all(out, np.repeat(ranks * 0 + rank, count).astype(dt))
            assert_equal(out, np.repeat(ranks, count).astype(dt))
        _twice(all_to_all)

        def broadcast():
            t = np.full(count, rank, dt)
            comm.broadcast(t, root=n - 1)
            assert_equal(t, np.full(count, n - 1, dt))
        _twice(broadcast)

        def reduce():
            t = np.full(count, rank + 1, dt)
            comm.reduce(t, root=n - 1)
            assert_equal(t, np.full(count, n * (n + 1) // 2 if rank == n - 1 else rank + 1, dt))
        _twice(reduce)


def naming_an_algorithm_keeps_the_fast_path():
    """A call that names its algorithm runs on the fast path too (after the first), with
    the algorithm it named: schedules and direct alike (MPI's own stays general)."""
    for collective in ("all_reduce", "all_gather"):
        for name in comm.algorithms(collective):
            def call():
                if collective == "all_reduce":
                    t = np.full(5, rank + 1.0)
                    comm.all_reduce(t, algorithm=name)
                    assert_equal(t, np.full(5, n * (n + 1) / 2))
                else:
                    out = np.zeros(3 * n)
                    comm.all_gather(out, np.full(3, float(rank)), algorithm=name)
                    assert_equal(out, np.repeat(np.arange(n, dtype=float), 3))
            _twice(call)
            assert comm.flight_record()[-1]["algorithm"] == name, (name, comm.flight_record()[-1])


def a_shape_met_first_inside_another_call_still_runs_fast():
    """ordered's all_reduce runs an auto all_gather of 7 elements a rank inside it (not
    taught: it is not the dispatcher's call); a user's own auto all_gather of that shape
    must still be taught, and then run on the fast path."""
    t = np.full(7 * n, rank + 1.0)
    comm.all_reduce(t, algorithm="ordered")
    assert_equal(t, np.full(7 * n, n * (n + 1) / 2))

    def all_gather():
        out = np.zeros(7 * n)
        comm.all_gather(out, np.full(7, float(rank)))
        assert_equal(out, np.repeat(np.arange(n, dtype=float), 7))
    _twice(all_gather)


def in_place_forms():
    def all_gather():
        whole = np.zeros(6 * n, np.float32)
        whole[6 * rank:6 * rank + 6] = rank
        comm.all_gather(whole, whole[6 * rank:6 * rank + 6])
        assert_equal(whole, np.repeat(np.arange(n), 6).astype(np.float32))
    _twice(all_gather)

    def reduce_scatter():
        data = np.ones(6 * n, np.float32)
        comm.reduce_scatter(data[6 * rank:6 * rank + 6], data)
        assert_equal(data[6 * rank:6 * rank + 6], np.full(6, n, np.float32))
    _twice(reduce_scatter)


def ranks_may_take_different_paths():
    """A Buffer (general path) on one rank meets numpy arrays (fast path) elsewhere."""
    want = np.full(33, n * (n - 1) // 2, np.float32)
    for _ in range(2):
        t = np.full(33, rank, np.float32)
        comm.all_reduce(as_buffer(t) if rank == 0 else t)
        assert_equal(np.asarray(t), want)
    before = fast.taken
    t = np.full(33, rank, np.float32)
    comm.all_reduce(t, timeout=30)  # a per-call timeout takes the general path
    assert fast.taken == before
    comm.all_reduce(t)  # ... which leaves the transport on its own; the next call resets it
    comm.all_reduce(t)
    assert fast.timeout == comm.timeout
    assert fast.taken >= before + 1
    assert_equal(t, want * n ** 2)


def mpi_s_own_collectives_meet_across_paths():
    """MPI's own collectives (native) on Buffers on rank 0 (the general path) meet numpy
    arrays on the other ranks (the fast path, where the transport runs them): both agree
    first and make the same MPI call, whichever collective it is."""
    if "native" not in comm.algorithms("all_reduce"):
        return
    count, ranks = 1000, np.arange(n)
    as_given = as_buffer if rank == 0 else (lambda a: a)
    for dt in ("float32", "int64", "float16"):
        for _ in range(2):
            t = np.full(count, rank + 1, dt)
            comm.all_reduce(as_given(t), algorithm="native")
            assert_equal(t, np.full(count, n * (n + 1) // 2, dt))
            out = np.zeros(count * n, dt)
            comm.all_gather(as_given(out), as_given(np.full(count, rank, dt)),
                            algorithm="native")
            assert_equal(out, np.repeat(ranks, count).astype(dt))
            out = np.zeros(count, dt)
            comm.reduce_scatter(as_given(out), as_given(np.repeat(ranks + rank, count)
                                                        .astype(dt)), algorithm="native")
            assert_equal(out, np.full(count, n * rank + n * (n - 1) // 2, dt))
            out = np.zeros(count * n, dt)
            comm.all_to_all(as_given(out), as_given(np.full(count * n, rank, dt)),
                            algorithm="native")
            assert_equal(out, np.repeat(ranks, count).astype(dt))
            t = np.full(count, rank, dt)
            comm.broadcast(as_given(t), root=n - 1, algorithm="native")
            assert_equal(t, np.full(count, n - 1, dt))
            t = np.full(count, rank + 1, dt)
            comm.reduce(as_given(t), root=0, algorithm="native")
            assert_equal(t, np.full(count, n * (n + 1) // 2 if rank == 0 else rank + 1, dt))


def torch_cpu_tensors_run_fast():
    """Plain CPU tensors (torch.Tensor, nn.Parameter) take the fast path as numpy arrays
    do; what it declines (another layout, a non-contiguous tensor, a subclass, a dtype
    commlib lacks) the general path takes, with its results or errors."""
    if torch is None:
        return
    for count in (1, 7, 5000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            def all_reduce():
                t = torch.full((count,), rank + 1, dtype=dtype)
                assert comm.all_reduce(t) is t
                assert_equal(t.float().numpy(), np.full(count, n * (n + 1) // 2, np.float32))
            _twice(all_reduce)
    p = torch.nn.Parameter(torch.full((2, 3), float(rank)), requires_grad=False)
    _twice(lambda: comm.broadcast(p, root=n - 1))
    assert_equal(p.numpy(), np.full((2, 3), n - 1, np.float32))

    class Marked(torch.Tensor):  # a subclass may mean something else by its memory
        pass
    taken = fast.taken
    t = torch.full((7,), 1.0).as_subclass(Marked)
    for _ in range(2):
        comm.all_reduce(t)
    assert fast.taken == taken, "a tensor subclass ran on the fast path"
    assert_equal(t.as_subclass(torch.Tensor).numpy(), np.full(7, n * n, np.float32))
    raises(ValueError, "not contiguous", lambda: comm.all_reduce(torch.ones(14)[::2]))
    raises(TypeError, "torch.bool is not supported",
           lambda: comm.all_reduce(torch.ones(7, dtype=torch.bool)))
    raises(ValueError, "layout torch.sparse_coo",
           lambda: comm.all_reduce(torch.ones(7).to_sparse()))
    assert fast.taken == taken


def declined_calls_raise_the_general_paths_errors():
    t = np.full(8, 1.0, np.float32)
    comm.all_reduce(t)
    comm.all_reduce(t)  # known now
    frozen = t.copy()
    frozen.flags.writeable = False
    raises(ValueError, "read-only", lambda: comm.all_reduce(frozen))
    raises(ValueError, "not contiguous", lambda: comm.all_reduce(np.ones(16, np.float32)[::2]))
    raises(ValueError, "outside the communicator", lambda: comm.broadcast(t, root=n))
    raises(ValueError, "unknown reduce op None", lambda: comm.all_reduce(t, op=None))
    raises(ValueError, "needs a floating dtype", lambda: comm.all_reduce(np.ones(8, np.int32),
                                                                         op="avg"))
    raises(ValueError, "expected size * input.numel",
           lambda: comm.all_gather(np.zeros(8 * n + 1, np.float32), t))
    assert_equal(t, np.full(8, float(n * n), np.float32))  # nothing ran


def async_work_keeps_its_order():
    a, b = np.full(100, 1.0), np.full(100, 2.0)
    comm.all_reduce(b)
    comm.all_reduce(b)  # now known to the fast path
    work = comm.all_reduce(a, async_op=True)
    comm.all_reduce(b)  # behind the async call: the general path, in order
    work.wait()
    assert_equal(a, np.full(100, float(n)))
    assert_equal(b, np.full(100, 2.0 * n ** 3))


def flight_record_numbers_both_paths_in_order():
    os.environ["COMMLIB_FLIGHT_RECORDER"] = "5"
    try:
        c = commlib.Communicator(MPI.COMM_WORLD)
    finally:
        del os.environ["COMMLIB_FLIGHT_RECORDER"]
    try:
        t, out = np.ones(6, np.int32), np.zeros(6 * n, np.int32)
        for _ in range(2):  # the second of each runs on the fast path
            c.all_reduce(t, op="max")
            c.all_gather(out, t)
        c.all_reduce(t, timeout=30)  # general
        c.broadcast(t, 0)  # general, then fast
        c.broadcast(t, 0)
        taken = c._calls.fast.native.taken
        rows = c.flight_record()
        assert [r["seq"] for r in rows] == list(range(3, 8)), rows  # the last 5 of 7
        assert [r["collective"] for r in rows] == ["all_reduce", "all_gather", "all_reduce",
                                                   "broadcast", "broadcast"], rows
        fast_gather, general, fast_broadcast = rows[1], rows[2], rows[4]
        assert taken == 3
        assert fast_gather["op"] is None and fast_gather["root"] is None
        assert fast_gather["count"] == 6 and fast_gather["dtype"] == "int32"
        assert fast_broadcast["root"] == 0 and fast_broadcast["algorithm"] is not None
        assert rows[0]["op"] == "max" and general["op"] == "sum"
        for r in rows:
            assert r["state"] == "done" and r["issued"] <= r["started"] <= r["finished"], r
    finally:
        c.free()
    assert c.flight_record() == rows  # kept by a freed communicator
    assert c._calls.recorder.fast is None  # which lets go of its transport


def a_freed_communicator_lets_go_of_its_fast_path():
    c = commlib.Communicator(MPI.COMM_WORLD)
    t = np.ones(4, np.float32)
    for _ in range(2):
        c.all_reduce(t)
    path = weakref.ref(c._calls.fast)
    c.free()
    del c
    gc.collect()
    assert path() is None, "the fast path (and its shared memory) outlived its communicator"


def timeout_on_the_fast_path_ends_the_communicator():
    if n == 1:
        return
    c = comm.dup()
    c.timeout = 0.5
    t = np.ones(7)
    for _ in range(2):  # the second on the fast path
        c.all_reduce(t)
    try:
        if rank == 0:  # its peers never join
            taken = c._calls.fast.native.taken
            raises(CommTimeoutError, "collective #3 on rank 0 (all_reduce)",
                   lambda: c.all_reduce(t))
            assert c._calls.fast.native.taken == taken
            last, before = c.flight_record()[-2:][::-1]
            assert (last["seq"], last["state"], last["op"]) == (3, "failed", "sum"), last
            assert "CommTimeoutError" in last["error"] and before["state"] == "done"
            # held for good: the general path refuses the next call
            raises(CommError, "unusable after an earlier failure", lambda: c.all_reduce(t))
    finally:
        comm.mpi.Barrier()


def disagreement_on_the_fast_path_fails_every_rank():
    if n == 1:
        return
    c = commlib.Communicator(MPI.COMM_WORLD)

    def calls():
        for count in (4, 5):  # both known to every rank
            for _ in range(2):
                c.all_reduce(np.ones(count, np.float32))
        c.all_reduce(np.ones(4 if rank == 0 else 5, np.float32))  # on the fast path
    try:
        # a rank still finishing the call before may see the verdict there
        raises(CollectiveMismatchError, "count differs", calls)
        last = c.flight_record()[-1]
        assert last["state"] == "failed" and last["algorithm"] is None, last
    finally:
        c.free()


check.run_cases(globals())
