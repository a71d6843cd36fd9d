"""Collectives and send/recv on GPU arrays through pinned host memory (commlib/cuda/staging.py),
under mpiexec: results, stream order, async Works, errors.

On a GPU the arrays are torch CUDA tensors. On the simulated GPU (no GPU:
COMMLIB_CUDA_STREAMS, tests/simulated_gpu.py) they are host arrays behind a
__cuda_array_interface__ and streams are threads:
that checks the ordering logic, not CUDA."""
import ctypes
import time

import numpy as np
from mpi4py import MPI

import commlib
from commlib import cuda, settings
from harness import Checker, assert_equal, raises
from tests.simulated_gpu import HostArray

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
SIMULATED = bool(settings.get("COMMLIB_CUDA_STREAMS"))  # tests/simulated_gpu.py
IPC = n > 1 and comm.transport == "shm" and settings.get("COMMLIB_CUDA_IPC")
WAIT = 60


def device(values, dtype="float32"):
    """A device array holding ``values``."""
    host = np.asarray(values, dtype=np.float64).astype(dtype)
    if SIMULATED:
        return HostArray(host)
    import torch
    return torch.tensor(host).cuda()


def part(x, start, stop):
    """Elements [start, stop) of device array ``x``, sharing its memory."""
    if SIMULATED:
        return HostArray(x.host[start:stop])
    return x[start:stop]


_sources: list = []  # what the simulated GPU's copies enqueued below read, until they ran


def host(x) -> np.ndarray:
    """``x``'s values once the current stream has run everything enqueued so far."""
    if SIMULATED:
        cuda.streams().stream_synchronize(0, 0)
        _sources.clear()
        return x.host.astype(np.float64)
    return x.double().cpu().numpy()


def pause(seconds):
    """Enqueue a slow kernel on the current stream."""
    if SIMULATED:
        cuda.streams().sleep(0, seconds)
    else:
        import torch
        torch.cuda._sleep(int(seconds * 1e9))  # cycles: some 0.5 ns each


def slow_fill(x, value, seconds=0.05):
    """Enqueue: after a pause, fill ``x`` with ``value`` (the producer of a collective's input)."""
    pause(seconds)
    if SIMULATED:
        copy(x, device(np.full(x.host.shape, value), x.host.dtype.name))
    else:
        x.fill_(value)


def copy(dst, src):
    """Enqueue dst = src (a consumer of a collective's output)."""
    if SIMULATED:
        _sources.append(src)
        cuda.streams().copy_async(dst.host.ctypes.data, src.host.ctypes.data, src.host.nbytes,
                                  0, 0)
    else:
        dst.copy_(src)


def user_defined_and_bitwise_ops_staged():
    """The GPU kernels lack them: staged through host memory, where commlib's kernels run."""
    absmax = commlib.ReduceOp.define(lambda a, b: max(abs(a), abs(b)), ("float32", "float16"),
                                     name="absmax")
    for dtype in ("float32", "float16"):
        values = np.arange(1000) % 300  # (exact in float16 times n)
        comm.all_reduce(t := device(values * (-1.0) ** rank * (rank + 1), dtype), op=absmax)
        assert_equal(host(t), values * float(n))
    comm.all_reduce(t := device(np.full(6, 1 << rank), "int32"), op="bor")
    assert_equal(host(t), np.full(6, (1 << n) - 1))
    raises(ValueError, "'absmax' is defined for float16, float32, not float64",
           lambda: comm.all_reduce(device(np.ones(3), "float64"), op=absmax))


def deterministic_staged():
    """Deterministic mode: GPU arrays reduce on the host in rank order (not by the GPU's
    kernels or CUDA IPC), to the bits of the fold ((x0 + x1) + x2) ..."""
    def mine(r):
        rng = np.random.default_rng(r)
        return (rng.standard_normal(5000) * 10.0 ** rng.uniform(-3, 3, 5000)).astype(np.float32)
    det = comm.dup(deterministic=True)
    det.all_reduce(t := device(mine(rank)))
    want = mine(0)
    for r in range(1, n):
        want = want + mine(r)
    assert host(t).astype(np.float32).tobytes() == want.tobytes()
    ran = det.flight_record()[-1]["algorithm"]
    assert n <= 2 or ran in ("direct", "one_copy", "eager", "ordered"), ran
    det.free()


def every_collective():
    for dtype in ("float32", "int32", "float16"):
        t = device(np.arange(7) + rank, dtype)
        assert comm.all_reduce(t) is t
        assert_equal(host(t), n * np.arange(7) + n * (n - 1) / 2)
        comm.all_reduce(t := device(np.full(5, rank + 1.0), dtype), op="max")
        assert_equal(host(t), np.full(5, float(n)))
    comm.all_reduce(t := device(np.full(9, 2.0 * rank)), op="avg")
    assert_equal(host(t), np.full(9, n - 1.0))

    out, inp = device(np.zeros(3)), device(np.arange(3 * n) + rank)
    comm.reduce_scatter(out, inp)
    assert_equal(host(out), n * np.arange(3 * rank, 3 * rank + 3) + n * (n - 1) / 2)

    out, inp = device(np.zeros(2 * n)), device(np.full(2, float(rank)))
    comm.all_gather(out, inp)
    assert_equal(host(out), np.repeat(np.arange(n, dtype=float), 2))

    out, inp = device(np.zeros(n)), device(np.arange(n) + 10.0 * rank)
    comm.all_to_all(out, inp)
    assert_equal(host(out), np.arange(n) * 10.0 + rank)

    for root in range(n):
        comm.broadcast(t := device(np.full(4, float(rank))), root=root)
        assert_equal(host(t), np.full(4, float(root)))
        comm.reduce(t := device(np.full(4, 1.0 + rank)), root=root)
        assert_equal(host(t), np.full(4, n * (n + 1) / 2 if rank == root else 1.0 + rank))


def all_reduce_every_size_dtype_op():
    """Through CUDA IPC at 2+ ranks on one host (one or more steps, one- or two-shot as the
    environment sets them), else staged."""
    for count in (0, 1, 5, 1000, 10007):
        for dtype in ("float32", "float16", "float64", "int32", "int8", "uint8"):
            ops = ("sum", "max", "min", "prod") + (("avg",) if dtype.startswith("float") else ())
            for op in ops:
                values = (np.arange(count) * 7 + rank * 5) % 9 - (0 if dtype == "uint8" else 4)
                if op == "prod":
                    values = (np.array([1.0, 2.0, 1.0])[np.arange(count) % 3]
                              * (1 if rank else -1 if dtype != "uint8" else 1))
                t = device(values, dtype)
                comm.all_reduce(t, op=op)
                check_algorithm(through_slots(count, dtype))
                every = [((np.arange(count) * 7 + r * 5) % 9 - (0 if dtype == "uint8" else 4))
                         if op != "prod" else
                         np.array([1.0, 2.0, 1.0])[np.arange(count) % 3]
                         * (1 if r else -1 if dtype != "uint8" else 1)
                         for r in range(n)]
                want = {"sum": sum, "avg": lambda v: sum(v) / n,
                        "max": lambda v: np.max(v, axis=0), "min": lambda v: np.min(v, axis=0),
                        "prod": lambda v: np.prod(v, axis=0)}[op](np.array(every).reshape(n, count))
                got = host(t)
                if op == "avg":
                    assert np.allclose(got, want, atol=1e-2), (count, dtype, op)
                else:
                    assert_equal(got, np.asarray(want, np.float64).astype(dtype).astype(np.float64))


def gather_scatter_broadcast_reduce_in_many_steps():
    """Through CUDA IPC at 2+ ranks on one host (many steps with 4 KiB slots)."""
    m = 3001
    out, inp = device(np.zeros(m)), device(np.arange(n * m) + rank)
    comm.reduce_scatter(out, inp)
    assert_equal(host(out), n * np.arange(rank * m, rank * m + m) + n * (n - 1) / 2)
    check_algorithm("ipc")
    comm.reduce_scatter(out, inp, op="avg")
    assert_equal(host(out), np.arange(rank * m, rank * m + m) + (n - 1) / 2)
    out, inp = device(np.zeros(n * m)), device(np.arange(m) + 10000.0 * rank)
    comm.all_gather(out, inp)
    assert_equal(host(out), np.concatenate([np.arange(m) + 10000.0 * r for r in range(n)]))
    check_algorithm("ipc")
    out = device(np.zeros(n * m), "float16")
    inp = device(np.arange(n * m) % 1000 + rank, "float16")
    comm.all_to_all(out, inp)  # part j of rank r's input is part r of rank j's output
    assert_equal(host(out), np.concatenate([np.arange(rank * m, rank * m + m) % 1000 + j
                                            for j in range(n)]))
    check_algorithm("ipc")
    # uneven: rank r sends (r + 2j) % 4 * 700 elements to j (many steps, empty parts)
    out, inp, want = uneven_all_to_all(lambda r, j: (r + 2 * j) % 4 * 700)
    comm.all_to_all(out, inp, **uneven_splits(lambda r, j: (r + 2 * j) % 4 * 700))
    assert_equal(host(out), want)
    check_algorithm("ipc")
    for root in (0, n - 1):
        t = device(np.arange(m) + 100.0 * rank, "int32")
        comm.broadcast(t, root=root)
        assert_equal(host(t), np.arange(m) + 100.0 * root)
        check_algorithm("ipc")
        t = device(np.arange(m) + 100.0 * rank, "int32")
        comm.reduce(t, root=root, op="max")
        assert_equal(host(t), np.arange(m) + 100.0 * (n - 1 if rank == root else rank))
        check_algorithm("ipc")
        t = device(np.full(m, 2.0 * rank))
        comm.reduce(t, root=root, op="avg")
        assert_equal(host(t), np.full(m, n - 1.0 if rank == root else 2.0 * rank))


def uneven_splits(count):
    """all_to_all's splits where rank r sends count(r, j) elements to rank j."""
    return {"input_splits": [count(rank, j) for j in range(n)],
            "output_splits": [count(j, rank) for j in range(n)]}


def uneven_all_to_all(count, make=device):
    """(output, input, expected output) of that all_to_all: element k of what r sends to j
    is 1000 r + 100 j + k % 97."""
    inp = make(np.concatenate([1000 * rank + 100 * j + np.arange(count(rank, j)) % 97
                               for j in range(n)]))
    want = np.concatenate([1000 * j + 100 * rank + np.arange(count(j, rank)) % 97
                           for j in range(n)])
    return device(np.zeros(len(want))), inp, want


def through_slots(count, dtype):
    """The algorithm of an all_reduce on unregistered memory through IPC."""
    slot = settings.get("COMMLIB_CUDA_IPC_SLOT_BYTES")
    chunk = min(count * np.dtype(dtype).itemsize, slot)
    one = n == 2 or chunk <= settings.get("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES")
    return "oneshot" if one else "twoshot"


def check_algorithm(name):
    if IPC:
        assert comm.flight_record()[-1]["algorithm"] == name, comm.flight_record()[-1]


def in_place_and_uneven():
    whole = device(np.zeros(3 * n))
    mine = part(whole, 3 * rank, 3 * rank + 3)
    if SIMULATED:
        mine.host[:] = rank + 1.0
    else:
        mine.fill_(rank + 1.0)
    comm.all_gather(whole, mine)  # the input is the output's own block
    assert_equal(host(whole), np.repeat(np.arange(1.0, n + 1), 3))

    whole = device(np.arange(2 * n) + 1.0)
    mine = part(whole, 2 * rank, 2 * rank + 2)
    comm.reduce_scatter(mine, whole)  # the output is the input's own block
    assert_equal(host(mine), n * (np.arange(2 * rank, 2 * rank + 2) + 1.0))

    send_counts = [(rank + j) % 3 for j in range(n)]  # rank sends (rank + j) % 3 to j
    recv_counts = [(j + rank) % 3 for j in range(n)]
    inp = device(np.concatenate([np.full(c, 100.0 * rank + j) for j, c in enumerate(send_counts)]))
    out = device(np.zeros(sum(recv_counts)))
    comm.all_to_all(out, inp, output_splits=recv_counts, input_splits=send_counts)
    assert_equal(host(out), np.concatenate([np.full(c, 100.0 * j + rank)
                                            for j, c in enumerate(recv_counts)]))
    check_algorithm("ipc")


def stream_order():
    """The call reads its input after the kernels before it on the stream, and the kernels
    after it read its output; the call returns before the input is even written."""
    comm.all_reduce(warm := device(np.ones(2)))  # (sets up IPC, collectively: not timed)
    host(warm)
    t, seen = device(np.zeros(1000)), device(np.zeros(1000))
    slow_fill(t, rank + 1.0)
    start = time.monotonic()
    comm.all_reduce(t)
    returned = time.monotonic() - start
    copy(seen, t)
    assert_equal(host(seen), np.full(1000, n * (n + 1) / 2))
    assert returned < 0.04, f"the call waited {returned:.3f} s for the stream"
    # calls in a row: each reads what the one before wrote
    for _ in range(3):
        comm.all_reduce(t)
    assert_equal(host(t), np.full(1000, n ** 3 * n * (n + 1) / 2))


def async_works():
    t = device(np.full(100, rank + 1.0))
    slow_fill(t, rank + 2.0)
    w = comm.all_reduce(t, async_op=True)
    assert isinstance(w, commlib.Work)
    assert w.synchronize(WAIT) is True and w.is_completed() and w.result is t
    assert_equal(host(t), np.full(100, n * (n + 3) / 2))
    works = [comm.all_reduce(a := device(np.full(10, 1.0)), async_op=True),
             comm.all_gather(g := device(np.zeros(n)), device([float(rank)]), async_op=True)]
    for w in works:
        w.wait()  # the current stream waits for it; the host does not
    later = device(np.zeros(10))
    copy(later, a)
    assert_equal(host(later), np.full(10, float(n)))
    assert_equal(host(g), np.arange(n, dtype=float))


def send_and_recv():
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    out, got = device(np.zeros(5)), device(np.zeros(5))
    slow_fill(out, rank * 10.0)
    if rank % 2 == 0:
        comm.send(out, right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(out, right)
    assert_equal(host(got), np.full(5, left * 10.0))
    r = comm.recv(got2 := device(np.zeros(3)), left, tag=3, async_op=True)
    s = comm.send(device(np.full(3, rank + 0.5)), right, tag=3, async_op=True)
    commlib.wait_all([r, s], timeout=WAIT)
    assert_equal(host(got2), np.full(3, left + 0.5))


def cuda_aware_mpi_as_told():
    """COMMLIB_CUDA_AWARE_MPI=1: send and recv (send_and_recv) hand MPI the device memory,
    and so do the collectives that do not go through IPC, with MPI's own collective
    (native), except where its runner would touch the memory on the host."""
    said = settings.get("COMMLIB_CUDA_AWARE_MPI")
    if said is None:
        return
    assert cuda.mpi_is_cuda_aware() is (said == "1")
    if said != "1" or IPC:
        return
    comm.all_reduce(t := device(np.full(5, 2.0 * rank)), op="avg")
    assert comm.flight_record()[-1]["algorithm"] == "native"
    assert_equal(host(t), np.full(5, n - 1.0))  # averaged on the stream
    comm.all_reduce(t := device(np.full(5, 1.0), "float16"))  # staged: reduced on the host
    assert_equal(host(t), np.full(5, float(n)))
    whole = device(np.arange(2 * n) + 1.0)
    comm.reduce_scatter(part(whole, 2 * rank, 2 * rank + 2), whole)  # in place: staged
    assert_equal(host(whole)[2 * rank:2 * rank + 2], n * (np.arange(2 * rank, 2 * rank + 2) + 1.0))
    out, inp, want = uneven_all_to_all(lambda r, j: (r + j) % 3)
    comm.all_to_all(out, inp, **uneven_splits(lambda r, j: (r + j) % 3))
    assert comm.flight_record()[-1]["algorithm"] == "native"
    assert_equal(host(out), want)


def bad_calls():
    raises(ValueError, "put them all on one GPU",
           lambda: comm.all_gather(device(np.zeros(2 * n)), np.zeros(2, np.float32)))
    raises(ValueError, "expected size * input.numel",
           lambda: comm.all_gather(device(np.zeros(2 * n + 1)), device(np.zeros(2))))
    raises(ValueError, "algorithm='ipc' needs CUDA arrays",
           lambda: comm.all_reduce(np.ones(3, np.float32), algorithm="ipc"))
    if n == 1:
        raises(ValueError, "needs CUDA arrays", lambda: comm.all_to_all(
            device(np.zeros(1)), device(np.zeros(1)), algorithm="ipc"))
    if IPC:
        comm.all_reduce(t := device(np.ones(5)), algorithm="ipc")
        assert_equal(host(t), np.full(5, float(n)))
    t = device(np.full(3, 1.0))  # the communicator still works
    comm.all_reduce(t)
    assert_equal(host(t), np.full(3, float(n)))


def calls_on_two_streams_in_call_order():
    """An async call (our side stream) and the calls after it on the caller's stream run in
    call order on the GPU, not just on the host: the simulated GPU makes the async call's
    copies slow, so a later call that did not wait for it would overwrite the slot it
    still reads."""
    if not IPC:
        return
    m = 2000
    comm.all_gather(device(np.zeros(n)), device([1.0]), async_op=True).wait()  # side stream
    slow = None
    if SIMULATED:
        sim, side = cuda.streams(), comm._calls.staging._side[0]  # (white-box)
        slow = sim.copy_async

        def copy_async(dst, src, nbytes, dev, stream):
            if stream == side:
                sim.sleep(stream, 0.05)
            slow(dst, src, nbytes, dev, stream)
        sim.copy_async = copy_async
    try:
        first = device(np.zeros(n * m))
        w = comm.all_gather(first, device(np.arange(m) + 1000.0 * rank), async_op=True)
        later = [device(np.zeros(n * m)) for _ in range(3)]
        for k, out in enumerate(later):
            comm.all_gather(out, device(np.full(m, -1.0 - k)))
        w.wait()
    finally:
        if slow is not None:
            sim.copy_async = slow
    assert_equal(host(first), np.concatenate([np.arange(m) + 1000.0 * r for r in range(n)]))
    for k, out in enumerate(later):
        assert_equal(host(out), np.full(n * m, -1.0 - k))


def device_memory(count, dtype="float32"):
    """An uninitialised device array from the device allocator (cudaMalloc; on the
    simulated GPU, shared memory), which register can share."""
    if SIMULATED:
        nbytes = count * np.dtype(dtype).itemsize
        ptr = cuda.streams().device_alloc(nbytes, 0)
        return HostArray(np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype))
    import torch
    return torch.empty(count, dtype=getattr(torch, dtype), device="cuda")


def fill(x, values):
    """Enqueue x[:] = values."""
    copy(x, device(values, x.host.dtype.name if SIMULATED else str(x.dtype)[6:]))


def registered_all_reduce():
    """Zero-copy all_reduce on registered memory: whole, in parts at different offsets on
    each rank, averaged, in stream order, between slot calls; after close(), slots again."""
    if not IPC:
        if n == 1:
            raises(ValueError, "needs 2 to 16 ranks", lambda: comm.register(device(np.ones(2))))
        return
    raises(TypeError, "host memory", lambda: comm.register(np.ones(4, np.float32)))
    for dtype in ("float32", "float16", "int32"):
        big = device_memory(3001, dtype)
        with comm.register(big) as reg:
            fill(big, np.arange(3001) % 11 + rank)
            comm.all_reduce(big)
            check_algorithm("zerocopy")
            assert_equal(host(big), n * (np.arange(3001) % 11) + n * (n - 1) / 2)
            for count in (0, 1, n + 1, 1000):  # parts: some ranks' share is empty
                mine = part(big, 7 * rank, 7 * rank + count)  # where differs by rank
                fill(mine, np.arange(count) + rank)
                comm.all_reduce(mine, op="max")
                check_algorithm("zerocopy")
                assert_equal(host(mine), np.arange(count) + n - 1.0)
        assert "closed" in repr(reg)
        comm.all_reduce(big)  # unregistered again: through the slots
        check_algorithm(through_slots(3001, dtype))
    t = device_memory(1000)
    seen = device(np.zeros(1000))
    with comm.register(t):
        slow_fill(t, rank + 1.0, seconds=1.0)
        start = time.monotonic()
        comm.all_reduce(t, op="avg")
        returned = time.monotonic() - start
        copy(seen, t)
        assert_equal(host(seen), np.full(1000, (n + 1) / 2))
        # it waits on the host for its peers to issue it (they exchange where their inputs
        # lie), not for the stream
        assert returned < 0.5, f"the call waited {returned:.3f} s for the stream"
        u = device(np.full(5, 1.0))
        for _ in range(3):  # counters shared with slot calls, async too
            w = comm.all_reduce(t, async_op=True)
            comm.all_reduce(u)
            w.wait()
        assert_equal(host(t), np.full(1000, n ** 3 * (n + 1) / 2))
        assert_equal(host(u), np.full(5, float(n) ** 3))


def registered_inputs_everywhere():
    """Every collective whose input is registered at every rank reads the peers' inputs
    where they lie (at offsets that differ by rank): zero-copy."""
    if not IPC:
        return
    m = 1001
    memory = device_memory(8 * n * m + 64)
    with comm.register(memory):
        at = 3 * rank  # where this rank's inputs start in its registered memory
        inp = part(memory, at, at + n * m)
        fill(inp, np.arange(n * m) + rank)
        out = device(np.zeros(m))
        comm.reduce_scatter(out, inp)
        check_algorithm("zerocopy")
        assert_equal(host(out), n * np.arange(rank * m, rank * m + m) + n * (n - 1) / 2)
        comm.reduce_scatter(out, inp, op="avg")
        assert_equal(host(out), np.arange(rank * m, rank * m + m) + (n - 1) / 2)

        block = part(memory, at, at + m)
        fill(block, np.arange(m) + 10000.0 * rank)
        out = device(np.zeros(n * m))
        comm.all_gather(out, block)
        check_algorithm("zerocopy")
        assert_equal(host(out), np.concatenate([np.arange(m) + 10000.0 * r for r in range(n)]))
        whole = part(memory, 0, n * m)  # in place: the input is the output's own block
        fill(part(whole, rank * m, rank * m + m), np.full(m, rank + 1.0))
        comm.all_gather(whole, part(whole, rank * m, rank * m + m))
        check_algorithm("zerocopy")
        assert_equal(host(whole), np.repeat(np.arange(1.0, n + 1), m))

        for root in (0, n - 1):
            t = part(memory, at, at + m)
            fill(t, np.arange(m) + 100.0 * rank)
            comm.broadcast(t, root=root)
            check_algorithm("zerocopy")
            assert_equal(host(t), np.arange(m) + 100.0 * root)
            fill(t, np.arange(m) + 100.0 * rank)
            comm.reduce(t, root=root, op="max")
            check_algorithm("zerocopy")
            assert_equal(host(t), np.arange(m) + 100.0 * (n - 1 if rank == root else rank))
            fill(t, np.full(m, 2.0 * rank))
            comm.reduce(t, root=root, op="avg")
            assert_equal(host(t), np.full(m, n - 1.0 if rank == root else 2.0 * rank))

        def count(r, j):
            return (r + 2 * j) % 4 * 300

        def in_memory(values):
            t = part(memory, at, at + len(values))
            fill(t, values)
            return t
        out, inp, want = uneven_all_to_all(count, in_memory)
        comm.all_to_all(out, inp, **uneven_splits(count))
        check_algorithm("zerocopy")
        assert_equal(host(out), want)
        out = device(np.zeros(n * m))  # an unregistered input goes through the slots
        comm.all_gather(out, device(np.arange(m) + 10000.0 * rank))
        check_algorithm("ipc")


def counters_move_while_the_main_thread_holds_the_gil():
    """A call through IPC goes on while this process's main thread holds the GIL (a long
    computation in C that never lets it go): its meetings are the GPU proxy's, not a Python
    thread's. The stream sleeps first, so that the whole call runs during the hold; where
    it finished before the hold began on some rank (one descheduled longer than the sleep:
    a loaded machine), that proves nothing, and it is tried again with a longer sleep."""
    if not IPC:
        return
    comm.all_reduce(device(np.ones(2)))  # (sets up IPC, collectively)
    gpu = comm._calls._gpus[0]  # (white-box: the counter the streams wait for)
    go = ctypes.c_uint32.from_address(gpu.go[0])
    # several steps where slots are small (4 KiB in the many-steps runs), yet few enough
    # ops that enqueuing them never fills the stream's queue (the caller would block until
    # the sleep ended, and the call could end before the hold)
    count = 3 * 1024
    for seconds in (1.0, 3.0, 9.0):
        t = device(np.full(count, rank + 1.0))
        host(t)
        comm.barrier()
        pause(seconds)
        comm.all_reduce(t)
        before = go.value
        ctypes.PyDLL(None).usleep(int((seconds + 0.5) * 1e6))  # holds the GIL
        after = go.value
        assert_equal(host(t), np.full(count, n * (n + 1) / 2))
        if not comm.mpi.allreduce(before == gpu.step, op=MPI.LOR):
            break
    assert before < after == gpu.step, (before, after, gpu.step)


def registered_on_one_rank_only_is_a_mismatch():
    if not IPC:
        return
    c = comm.dup()
    t = device_memory(64)
    fill(t, np.ones(64))
    reg = c.register(t) if rank == 0 else c.register(device_memory(64))
    c.all_reduce(t if rank == 0 else device(np.ones(64)))  # registered at rank 0 only
    host(t)  # the stream goes on
    raises(commlib.CommError, "an earlier collective on GPU buffers failed",
           lambda: c.all_reduce(device(np.zeros(3))))
    reg._gpu = None  # the communicator is unusable now: nothing to close collectively


def a_failure_releases_the_stream_and_is_raised_next():
    if n == 1:
        return
    c, c2 = comm.dup(), comm.dup()
    for d in (c, c2):  # the first all_reduce sets up IPC, collectively, before it returns
        d.all_reduce(device(np.ones(2)))
    if rank == 0:  # nobody else joins: they time out, and the stream must go on anyway
        start = time.monotonic()
        c.all_reduce(t := device(np.full(4, 1.0)), timeout=0.2)
        host(t)
        assert time.monotonic() - start < 30
        raises(commlib.CommError, "an earlier collective on GPU buffers failed",
               lambda: c.all_reduce(t))
        raises(commlib.CommError, "unusable", lambda: c.all_reduce(t))  # the timeout's doing
        w = c2.all_reduce(u := device(np.zeros(2)), async_op=True, timeout=0.2)
        raises(commlib.CommTimeoutError, "timed out", lambda: w.synchronize(WAIT))
        host(u)
        raises(commlib.CommError, "unusable", lambda: c2.all_reduce(u))  # raised once only
    comm.barrier()


def a_stream_slower_than_the_timeout_fails_the_call():
    """A call whose stream has not reached it within its timeout (a slow kernel before it)
    fails as a call whose peers do not come: raised by the next call, and the communicator
    unusable after (its peers may be inside the call), on the staged path as through IPC."""
    if n == 1:
        return
    c = comm.dup()
    c.all_reduce(device(np.ones(2)))  # (sets up IPC, collectively)
    if rank == 0:
        t = device(np.full(4, 1.0))
        pause(0.3)
        c.all_reduce(t, timeout=0.1)
        host(t)
        raises(commlib.CommError, "an earlier collective on GPU buffers failed",
               lambda: c.all_reduce(t, timeout=5))
        raises(commlib.CommError, "unusable", lambda: c.all_reduce(t, timeout=5))
    comm.barrier()


def a_mismatch_is_raised_by_the_next_call():
    if n == 1:
        return
    c = comm.dup()
    c.all_reduce(device(np.ones(2)))  # sets up IPC, collectively, before it returns
    c.all_reduce(t := device(np.zeros(4 if rank == 0 else 5)))  # returns; fails on the host
    host(t)  # the stream goes on
    raises(commlib.CommError, "an earlier collective on GPU buffers failed",
           lambda: c.all_reduce(device(np.zeros(3))))
    c = comm.dup()  # all_to_all splits that do not match: rank 0 sends 2 to rank 1, who
    c.all_reduce(device(np.ones(2)))  # expects 1
    splits = [2 if rank == 0 and j == 1 else 1 for j in range(n)]
    c.all_to_all(out := device(np.zeros(n)), device(np.zeros(sum(splits))),
                 output_splits=[1] * n, input_splits=splits)
    host(out)
    raises(commlib.CommError, "splits", lambda: c.all_reduce(device(np.zeros(3))))


check.run_cases(globals())
