"""The public collectives. Each validates its arguments locally (ValueError/TypeError before
anything is sent), picks an algorithm, and runs it. ``comm=None`` means the world.

A rank whose arguments fail validation still joins the call's agreement, with an invalid
descriptor (``_tell_peers``): its peers then raise CollectiveMismatchError at once
instead of waiting for it until the timeout, whichever rank's arguments were bad."""
from __future__ import annotations

import functools
import operator

import numpy as np
from mpi4py import MPI

from . import _C
from .buffers import Buffer, as_buffer
from .calls import (NONE, REDUCING, check_timeout,
                    descriptor, invalid_descriptor)
from .errors import CollectiveMismatchError, CommError
from .ops import ReduceOp
from . import cuda
from .cuda import ipc
from .cuda.staging import wait_event
from .work import Deadline, finished, in_thread, wait_request

# the codes the fast path (comm._fast.call) takes
(ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, BROADCAST, REDUCE) = (
    _C.COLLECTIVES[c] for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                "broadcast", "reduce"))


def _comm(comm):
    if comm is None:
        from .comm import init
        return init()
    try:
        freed = comm._executor is None  # Communicator.free() drops its executor
    except AttributeError:
        raise TypeError(f"comm must be a commlib.Communicator (or None for the world), got "
                        f"{type(comm).__name__}") from None
    if freed:
        raise CommError("this communicator has been freed; use a live one")
    return comm


def _check_rank(comm, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value < comm.size:
        raise ValueError(f"{what}={value} is outside the communicator (size {comm.size})")
    return value


def _same_dtype(a: Buffer, b: Buffer, names: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{names} must have the same dtype, got {a.dtype.name} and {b.dtype.name}")


def _prepare(comm, collective, algorithm, bufs, count, dtype, op, params, timeout=None,
             check=True):
    """Choose the algorithm and plan now (so bad names raise here); return the call. The
    call records itself in the flight recorder, is bounded by the timeout and, off shared
    memory (whose transport checks every call itself), first checks that every rank made
    the same call (``check``; calls.py)."""
    on_device = any(b.device is not None for b in bufs.values())
    in_place = on_device and _mpi_takes_device_memory(comm, collective, algorithm, bufs, dtype)
    algo, plan = comm._plan(collective, "native" if in_place else algorithm, count,
                            dtype.itemsize, tuple(sorted(params.items())) if params else ())
    average = op is ReduceOp.AVG and (collective != "reduce" or comm.rank == params["root"])
    staged = None
    if on_device:  # GPU memory: run on host twins, or on itself with a CUDA-aware MPI
        comm.staging.raise_failure()  # raised now: a call returns before it runs
        if comm._failure is not None:
            raise comm._unusable()
        if in_place:
            staged = comm.staging.in_place(bufs, {k: _device_view(b) for k, b in bufs.items()},
                                           1.0 / comm.size if average else None)
            average = False  # the stream scales it (the host cannot touch device memory)
        else:
            staged = comm.staging.stage(bufs, *_staged_io(collective, bufs, comm.rank,
                                                          params.get("root")))
        bufs = staged.host
    op_code = _C.OPS[op.value]
    executor = comm._executor
    seconds = comm.timeout if timeout is None else check_timeout(timeout)
    record = comm._recorder.issue(collective, algo.name, count, dtype.name,
                                  op.value if collective in REDUCING else None,
                                  params.get("root"))
    # shared memory checks its own calls; MPI's collectives on it meet there first
    agree = check and (comm._check_agreement or plan is None and algo.name == "native"
                       and comm.transport == "shm")

    what = f"{collective} ({algo.name})"

    def body():
        if executor.timeout != seconds:
            executor.set_timeout(seconds)
        if agree:
            splits = None
            if collective == "all_to_all":
                splits = [[s * dtype.itemsize for s in params[k]]
                          for k in ("input_splits", "output_splits")]
            desc = descriptor(collective, algo.name, count, dtype.code, op_code,
                              params.get("root", NONE))
            _agree(comm, desc, dtype.itemsize, splits, seconds)
        if plan is None:
            if comm._layout is not None:  # hier runs collectives of its own
                comm._layout.bound(seconds)
            algo.run(comm, bufs, dtype, op.value, **params)
        else:
            executor.run(plan, bufs, dtype.code, op_code)
        if average:
            target = bufs["out"]
            _C.scale(target.ptr, target.numel, dtype.code, 1.0 / comm.size)

    def call():
        comm._run_recorded(record, what, body)

    call.staged, call.seconds = staged, seconds  # for _run
    return call


def _mpi_takes_device_memory(comm, collective, algorithm, bufs, dtype) -> bool:
    """Whether a call on GPU memory goes to MPI's own collective on the device memory
    itself (a CUDA-aware MPI): not where the native runner touches the memory on the host
    (16-bit floats reduce with our CPU kernels; in-place reduce_scatter copies its
    result), nor under Open MPI, whose non-blocking collectives (ours, so that they time
    out) take no device memory."""
    return (algorithm in (None, "native") and _mpi_moves_device_memory(comm)
            and not (collective in REDUCING and dtype.itemsize == 2 and dtype.floating)
            and not (collective == "reduce_scatter" and bufs["out"].overlaps(bufs["in"]))
            and not _open_mpi())


@functools.lru_cache(maxsize=None)
def _open_mpi() -> bool:
    return "Open MPI" in MPI.Get_library_version()


def _staged_io(collective: str, bufs: dict, rank: int, root) -> tuple[list, list]:
    """The buffers a call on GPU memory copies to the host before it runs (what it reads)
    and back after (what it writes)."""
    reads, writes = ["in" if "in" in bufs else "out"], ["out"]
    if collective == "broadcast":
        return (reads, []) if rank == root else ([], writes)
    if collective == "reduce" and rank != root:  # the others' t is unchanged
        return reads, []
    return reads, writes


def _run(comm, what: str, call, async_op: bool, result):
    """Run a prepared call on the communicator's engine; a call on GPU memory is enqueued
    on the caller's stream instead (cuda/staging.py) and returns at once."""
    if call.staged is None:
        return comm._engine.run(what, call, async_op, result)
    return comm.staging.issue(comm._engine, what, call, call.staged, async_op, result,
                              call.seconds)


def _agree(comm, desc: list, itemsize: int, splits, seconds) -> None:
    """Raise CollectiveMismatchError on every rank unless all made the call ``desc``
    describes (with these all_to_all ``splits``): shared memory compares what the ranks
    publish, other transports exchange it."""
    if comm.transport == "shm":
        comm._executor.transport.agree(desc, *(splits or ([], [])), itemsize)
    else:
        comm._agreement.check(desc, itemsize, splits, seconds)


def _tell_peers(comm, collective: str, error: Exception) -> None:
    """``error`` (ValueError/TypeError: this rank's arguments are invalid) is about to be
    raised; first tell the peers, when the communicator checks agreement at all (shared
    memory always, else unless COMMLIB_CHECK=0). Ranks whose arguments are all invalid agree
    and raise their own errors; valid peers raise CollectiveMismatchError naming the
    invalid ranks. (Each collective catches its own validation errors: a try block costs
    nothing on the calls that pass, a context manager would on every call.)"""
    if comm.size > 1 and (comm.transport == "shm" or comm._check_agreement):
        problem = _announce_invalid(comm, collective)
        if problem:
            error.add_note(f"commlib: {problem}")


def _announce_invalid(comm, collective: str) -> str | None:
    """Join the agreement of this call with an invalid descriptor; returns what the peers
    made of it, when that is not what they did themselves."""
    record = comm._recorder.issue(collective, "invalid", None, None)
    desc = invalid_descriptor(collective)

    def body():
        comm._executor.set_timeout(comm.timeout)
        _agree(comm, desc, 1, None, comm.timeout)

    try:
        comm._engine.run(collective, lambda: comm._run_recorded(record, collective, body),
                         async_op=False)
    except CollectiveMismatchError:
        return "its peers made a valid call; they raise CollectiveMismatchError"
    except CommError as e:
        return f"telling its peers that the call is invalid failed: {e}"
    return None


def execute(comm, collective, bufs, count, dtype, op=ReduceOp.SUM, algorithm=None, **params):
    """Run a collective on Buffers now, on this thread: for algorithms built from others
    (hier), which already run on their own communicator's engine and whose own call
    checked that the ranks agree."""
    _prepare(comm, collective, algorithm, bufs, count, dtype, op, params, check=False)()


def all_reduce(t, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    """Reduce ``t`` over all ranks, in place; returns ``t`` (a Work if ``async_op``)."""
    comm = _comm(comm)
    if (comm._fast and algorithm is None and not async_op and timeout is None
            and comm._fast.call(ALL_REDUCE, t, None, op, None)):
        return t
    try:
        buf = as_buffer(t, "t")
        reduce_op = ReduceOp.parse(op, buf.dtype)
        done = _via_ipc(comm, "all_reduce", algorithm, [buf], buf.numel, buf.dtype, reduce_op,
                        NONE, async_op, timeout, t, lambda gpu, c: gpu.all_reduce(
                            c, buf, _C.OPS[reduce_op.value], reduce_op is ReduceOp.AVG))
        if done is not None:
            return done
        call = _prepare(comm, "all_reduce", algorithm, {"out": buf}, buf.numel, buf.dtype,
                        reduce_op, {}, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "all_reduce", e)
        raise
    return _run(comm, "all_reduce", call, async_op, t)


def _via_ipc(comm, collective, algorithm, bufs, count, dtype, op, root, async_op, timeout,
             result, run):
    """A collective on GPU memory among the ranks of one host, through CUDA IPC
    (cuda/ipc.py): ``run(ipc, call)`` enqueues it. None where it does not apply (host
    memory, another algorithm asked for, ranks on several hosts, or some rank that cannot
    map its peers' memory): every rank then takes the other paths alike."""
    if algorithm not in (None, "ipc"):
        return None
    if not ipc.usable(comm, *bufs):
        if algorithm == "ipc":
            raise ValueError(f"{collective}: algorithm='ipc' needs CUDA arrays on one device "
                             f"and 2 to {ipc.MAX_RANKS} ranks of one host sharing memory")
        return None
    seconds = comm.timeout if timeout is None else check_timeout(timeout)
    staging = comm.staging
    staging.raise_failure()
    if comm._failure is not None:
        raise comm._unusable()
    op_code = _C.OPS[op.value] if collective in REDUCING else NONE
    array = bufs[0].device
    gpu = staging.ipc(comm, array.device,
                      descriptor(collective, "ipcsetup", count, dtype.code, op_code, root),
                      dtype.itemsize, seconds)
    if gpu is None:
        if algorithm == "ipc":
            raise CommError(f"{collective}: algorithm='ipc' is unavailable here: "
                            f"{staging.ipc_problem(array.device)}")
        return None
    return run(gpu, ipc.Call(comm, staging, collective, array, dtype, async_op, result,
                             seconds, [b.obj for b in bufs]))


def _check_whole_and_block(comm, collective, whole, whole_name, block, block_name):
    """reduce_scatter/all_gather buffers: ``whole`` holds size blocks of ``block``'s size. The
    only overlap allowed is ``block`` being exactly whole's own block (the in-place form)."""
    _same_dtype(whole, block, f"{whole_name} and {block_name}")
    if whole.numel != comm.size * block.numel:
        raise ValueError(f"{collective}: {whole_name} has {whole.numel} elements, expected size * "
                         f"{block_name}.numel = {comm.size} * {block.numel} = "
                         f"{comm.size * block.numel}")
    if block.overlaps(whole) and block.ptr != whole.ptr + comm.rank * block.nbytes:
        raise ValueError(f"{collective}: {block_name} overlaps {whole_name}; the only overlap "
                         f"allowed is {block_name} being exactly {whole_name}'s own block "
                         f"{whole_name}[rank*n:(rank+1)*n]")


def reduce_scatter(output, input, op="sum", algorithm=None, comm=None, async_op=False,
                   timeout=None):
    """Reduce ``input`` (size * output.numel elements) over all ranks; rank r keeps block r."""
    comm = _comm(comm)
    if (comm._fast and algorithm is None and not async_op and timeout is None
            and comm._fast.call(REDUCE_SCATTER, output, input, op, None)):
        return output
    try:
        out, inp = as_buffer(output, "output"), as_buffer(input, "input", writable=False)
        _check_whole_and_block(comm, "reduce_scatter", inp, "input", out, "output")
        reduce_op = ReduceOp.parse(op, out.dtype)
        done = _via_ipc(comm, "reduce_scatter", algorithm, [out, inp], out.numel, out.dtype,
                        reduce_op, NONE, async_op, timeout, output, lambda gpu, c:
                        gpu.reduce_scatter(c, out, inp, _C.OPS[reduce_op.value],
                                           reduce_op is ReduceOp.AVG))
        if done is not None:
            return done
        call = _prepare(comm, "reduce_scatter", algorithm, {"out": out, "in": inp}, out.numel,
                        out.dtype, reduce_op, {}, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "reduce_scatter", e)
        raise
    return _run(comm, "reduce_scatter", call, async_op, output)


def all_gather(output, input, algorithm=None, comm=None, async_op=False, timeout=None):
    """Concatenate every rank's ``input`` into ``output`` (size * input.numel elements)."""
    comm = _comm(comm)
    if (comm._fast and algorithm is None and not async_op and timeout is None
            and comm._fast.call(ALL_GATHER, output, input, None, None)):
        return output
    try:
        out, inp = as_buffer(output, "output"), as_buffer(input, "input", writable=False)
        _check_whole_and_block(comm, "all_gather", out, "output", inp, "input")
        done = _via_ipc(comm, "all_gather", algorithm, [out, inp], inp.numel, inp.dtype, None,
                        NONE, async_op, timeout, output,
                        lambda gpu, c: gpu.all_gather(c, out, inp))
        if done is not None:
            return done
        call = _prepare(comm, "all_gather", algorithm, {"out": out, "in": inp}, inp.numel,
                        inp.dtype, ReduceOp.SUM, {}, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "all_gather", e)
        raise
    return _run(comm, "all_gather", call, async_op, output)


def _splits(comm, splits, total: int, name: str) -> tuple:
    if splits is None:
        if total % comm.size:
            raise ValueError(f"all_to_all: {name.removesuffix('_splits')} has {total} elements, not divisible by "
                             f"size {comm.size}; pass {name} to split it unevenly")
        return (total // comm.size,) * comm.size
    if hasattr(splits, "tolist"):  # numpy arrays, tensors
        splits = splits.tolist()
    try:
        splits = tuple(operator.index(s) for s in splits)
    except TypeError:
        raise TypeError(f"all_to_all: {name} must be integers, got {splits!r}") from None
    if len(splits) != comm.size:
        raise ValueError(f"all_to_all: {name} has {len(splits)} entries, expected one per rank "
                         f"({comm.size})")
    if any(s < 0 for s in splits):
        raise ValueError(f"all_to_all: {name} must be non-negative ints, got {list(splits)}")
    if sum(splits) != total:
        raise ValueError(f"all_to_all: {name} sum to {sum(splits)} but the tensor has "
                         f"{total} elements")
    return splits


def all_to_all(output, input, output_splits=None, input_splits=None, algorithm=None, comm=None,
               async_op=False, timeout=None):
    """Rank r sends input's j-th part to rank j, receiving rank j's r-th part into output.

    Splits count elements per peer (like torch's all_to_all_single); None means equal parts.
    """
    comm = _comm(comm)
    if (comm._fast and output_splits is None and input_splits is None and algorithm is None
            and not async_op and timeout is None
            and comm._fast.call(ALL_TO_ALL, output, input, None, None)):
        return output
    try:
        out, inp = as_buffer(output, "output"), as_buffer(input, "input", writable=False)
        _same_dtype(out, inp, "output and input")
        if out.overlaps(inp):
            raise ValueError("all_to_all: output and input overlap; use separate tensors")
        splits = {"input_splits": _splits(comm, input_splits, inp.numel, "input_splits"),
                  "output_splits": _splits(comm, output_splits, out.numel, "output_splits")}
        done = _via_ipc(comm, "all_to_all", algorithm, [out, inp], inp.numel, inp.dtype, None,
                        NONE, async_op, timeout, output, lambda gpu, c: gpu.all_to_all(
                            c, out, inp, splits["output_splits"], splits["input_splits"]))
        if done is not None:
            return done
        call = _prepare(comm, "all_to_all", algorithm, {"out": out, "in": inp}, inp.numel,
                        inp.dtype, ReduceOp.SUM, splits, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "all_to_all", e)
        raise
    return _run(comm, "all_to_all", call, async_op, output)


def broadcast(t, root=0, algorithm=None, comm=None, async_op=False, timeout=None):
    """Copy ``t`` from ``root`` to every rank, in place; returns ``t``."""
    comm = _comm(comm)
    if (comm._fast and algorithm is None and not async_op and timeout is None
            and comm._fast.call(BROADCAST, t, None, None, root)):
        return t
    try:
        buf = as_buffer(t, "t")
        root = _check_rank(comm, root, "root")
        done = _via_ipc(comm, "broadcast", algorithm, [buf], buf.numel, buf.dtype, None, root,
                        async_op, timeout, t, lambda gpu, c: gpu.broadcast(c, buf, root))
        if done is not None:
            return done
        call = _prepare(comm, "broadcast", algorithm, {"out": buf}, buf.numel, buf.dtype,
                        ReduceOp.SUM, {"root": root}, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "broadcast", e)
        raise
    return _run(comm, "broadcast", call, async_op, t)


def reduce(t, root=0, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    """Reduce ``t`` over all ranks into ``t`` on ``root``; other ranks' ``t`` is unchanged."""
    comm = _comm(comm)
    if (comm._fast and algorithm is None and not async_op and timeout is None
            and comm._fast.call(REDUCE, t, None, op, root)):
        return t
    try:
        buf = as_buffer(t, "t")
        reduce_op, root = ReduceOp.parse(op, buf.dtype), _check_rank(comm, root, "root")
        done = _via_ipc(comm, "reduce", algorithm, [buf], buf.numel, buf.dtype, reduce_op, root,
                        async_op, timeout, t, lambda gpu, c: gpu.all_reduce(
                            c, buf, _C.OPS[reduce_op.value], reduce_op is ReduceOp.AVG, root))
        if done is not None:
            return done
        call = _prepare(comm, "reduce", algorithm, {"out": buf}, buf.numel, buf.dtype,
                        reduce_op, {"root": root}, timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "reduce", e)
        raise
    return _run(comm, "reduce", call, async_op, t)


def barrier(comm=None, async_op=False, timeout=None):
    """Return once every rank has called barrier (a Work if ``async_op``)."""
    comm = _comm(comm)
    try:
        seconds = comm.timeout if timeout is None else check_timeout(timeout)
    except (ValueError, TypeError) as e:
        _tell_peers(comm, "barrier", e)
        raise
    record = comm._recorder.issue("barrier", None, 0, None)

    def body():
        if comm.transport == "shm":
            comm._executor.set_timeout(seconds)
            comm._executor.barrier()
        elif comm._check_agreement:  # an allgather is a barrier too
            comm._agreement.check(descriptor("barrier", "native", 0, NONE, NONE, NONE), 1,
                                  timeout=seconds)
        else:
            wait_request(comm._coll.Ibarrier(), Deadline(seconds), "its peers to arrive")

    def task():
        comm._run_recorded(record, "barrier", body)

    return comm._engine.run("barrier", task, async_op)


def _check_tag(tag):
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= 32767:
        raise ValueError(f"tag must be an int in [0, 32767], got {tag!r}")


def _check_peer(comm, peer, what):
    _check_rank(comm, peer, what)
    if peer == comm.rank:
        raise ValueError(f"{what}={peer} is this rank itself; a message to self would block "
                         "forever; copy locally instead")


def send(t, dst, tag=0, comm=None, async_op=False, timeout=None):
    """Send ``t`` to rank ``dst``; blocking, or a Work if ``async_op`` (keep ``t`` intact
    until it completes). Fails with CommTimeoutError if ``dst`` has not taken it within
    ``timeout`` seconds (default: the communicator's)."""
    comm = _comm(comm)
    deadline = Deadline(comm.timeout if timeout is None else check_timeout(timeout))
    buf = as_buffer(t, "t", writable=False)
    _check_peer(comm, dst, "dst")
    _check_tag(tag)
    comm._p2p_bytes_sent += buf.nbytes
    if buf.device is not None and _mpi_moves_device_memory(comm):
        return _send_host(comm, t, _on_device(buf, deadline, f"send to rank {dst}"), dst, tag,
                          async_op, deadline)
    if buf.device is not None:  # sent from a host copy, made once its stream gets there
        return _send_staged(comm, t, buf, dst, tag, async_op, deadline)
    return _send_host(comm, t, buf, dst, tag, async_op, deadline)


def _mpi_moves_device_memory(comm) -> bool:
    return comm.mpi is not None and cuda.mpi_is_cuda_aware()


def _on_device(buf, deadline, what: str):
    """For a CUDA-aware MPI: ``buf``'s device memory as MPI takes it, once the stream has
    done the work before the call (its producer, or the last reader of what a recv
    overwrites)."""
    reached = cuda.streams().Event(buf.device.device)
    reached.record(buf.device.stream)
    wait_event(reached, deadline.seconds, what)
    return _device_view(buf)


def _device_view(buf):
    """``buf``'s device memory as MPI takes it (by address)."""
    return Buffer(buf.obj, buf.ptr, buf.numel, buf.dtype,
                  MPI.buffer.fromaddress(buf.ptr, buf.nbytes))


def _send_staged(comm, t, buf, dst, tag, async_op, deadline):
    staging = comm.staging
    staged = staging.stage({"t": buf}, ["t"], [])
    try:
        staging.copy_to_host_now(staged, deadline.seconds, f"send to rank {dst}")
        work = _send_host(comm, t, staged.host["t"], dst, tag, True, deadline)
    except BaseException as e:
        staging.sent(staged, e)
        raise
    work.add_done_callback(lambda w: staging.sent(staged, w.exception()))
    if async_op:
        return work
    work.wait()
    return None


def _send_host(comm, t, buf, dst, tag, async_op, deadline):
    if comm.mpi is None:  # made from a store: the store holds the message at once
        comm._p2p.send(buf.bytes.tobytes(), dst, tag)
        return finished(f"send to rank {dst}") if async_op else None
    try:
        if async_op:
            return comm._poller.track(comm._p2p.Isend(buf.bytes, dst, tag),
                                      f"send to rank {dst}", None, deadline=deadline, keep=t)
        wait_request(comm._p2p.Isend(buf.bytes, dst, tag), deadline,
                     f"rank {dst} to receive (send, tag {tag})", keep=t)
    except MPI.Exception as e:
        raise CommError(f"send to rank {dst} failed inside MPI: {e}") from e
    return None


def recv(t, src, tag=0, comm=None, async_op=False, timeout=None):
    """Receive into ``t`` from rank ``src``; the message must fill ``t`` exactly. Blocking
    (returns ``t``), or a Work if ``async_op``. Fails with CommTimeoutError if nothing
    arrives within ``timeout`` seconds (default: the communicator's)."""
    comm = _comm(comm)
    deadline = Deadline(comm.timeout if timeout is None else check_timeout(timeout))
    buf = as_buffer(t, "t")
    _check_peer(comm, src, "src")
    _check_tag(tag)
    if buf.device is not None and _mpi_moves_device_memory(comm):  # Work.wait() blocks
        return _recv_host(comm, t, _on_device(buf, deadline, f"recv from rank {src}"), src,
                          tag, async_op, deadline)
    if buf.device is not None:  # received into a host copy; the stream copies it in after
        return _recv_staged(comm, t, buf, src, tag, async_op, deadline)
    return _recv_host(comm, t, buf, src, tag, async_op, deadline)


def _recv_staged(comm, t, buf, src, tag, async_op, deadline):
    from .cuda.staging import StagedWork
    staging = comm.staging
    staged = staging.stage({"t": buf}, [], ["t"])
    done = staging.copy_out(staged, staging.stream_for(staged.array, async_op))
    try:
        work = _recv_host(comm, t, staged.host["t"], src, tag, True, deadline)
    except BaseException as e:
        staging.host_part_over(staged, e)
        raise
    # a blocking receive raises its own error; nobody would raise an async one's
    work.add_done_callback(lambda w: staging.host_part_over(staged, w.exception(), async_op))
    if async_op:
        return StagedWork(f"recv from rank {src}", work, done, staged.array, t, staging)
    work.wait()
    return t


def _recv_host(comm, t, buf, src, tag, async_op, deadline):
    if comm.mpi is None:
        return _recv_from_store(comm, t, buf, src, tag, async_op)
    try:
        if async_op:
            return comm._poller.track(comm._p2p.Irecv(buf.bytes, src, tag),
                                      f"recv from rank {src}", t, expect_bytes=buf.nbytes,
                                      deadline=deadline, keep=t)
        status = MPI.Status()
        wait_request(comm._p2p.Irecv(buf.bytes, src, tag), deadline,
                     f"rank {src} to send (recv, tag {tag})", status, keep=t)
    except MPI.Exception as e:
        raise CommError(f"recv from rank {src} failed inside MPI (a message larger than "
                        f"the {buf.nbytes}-byte tensor?): {e}") from e
    got = status.Get_count(MPI.BYTE)
    if got != buf.nbytes:
        raise CommError(f"recv from rank {src}: got {got} bytes, tensor holds {buf.nbytes}")
    return t


def _recv_from_store(comm, t, buf, src, tag, async_op):
    receive = comm._p2p.post_recv(src, tag)  # claimed now: receives match in issue order

    def task():
        data = receive()
        if len(data) != buf.nbytes:
            raise CommError(f"recv from rank {src}: got {len(data)} bytes, tensor holds "
                            f"{buf.nbytes}")
        buf.bytes[:] = np.frombuffer(data, np.uint8)
        return t
    return in_thread(f"recv from rank {src}", task) if async_op else task()
