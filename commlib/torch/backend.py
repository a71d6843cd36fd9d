"""torch.distributed backend "commlib": torch's collectives run on commlib communicators.

Importing this module registers the backend. Under ``mpiexec``:

    import commlib.torch
    commlib.torch.init_process_group()   # rank, size and store set up from MPI
    # or the standard call, with ranks that match MPI.COMM_WORLD's:
    torch.distributed.init_process_group("commlib", rank=..., world_size=..., init_method=...)

Under mpiexec the default group is MPI.COMM_WORLD and ``new_group(ranks)`` becomes an MPI
communicator over those ranks. A launcher that forms no MPI world (``torchrun
--nproc-per-node N`` on one host) works too: each group's ranks then meet through torch's
store and run on shared memory (Communicator.from_store; send/recv go through the store).
Tensors are CPU or CUDA tensors of any dtype for data movement; reductions take commlib's
dtypes plus bool and complex (see ops.reduction). Every op with ``async_op=True``
returns at once and progresses on commlib's threads. Ops on CUDA tensors are
stream-ordered like NCCL's (_stream_ordered): among the GPU ranks of one host they go
through CUDA IPC (commlib/transports/cuda_ipc.py), else through pinned host memory
(commlib/cuda/staging.py). commlib/torch/hooks.py has a DDP hook that registers DDP's
gradient buckets, for zero-copy all-reduces.
"""
from __future__ import annotations

import functools
import os
import socket
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.autograd import _profiler_enabled

from .. import abort
from ..comm import Communicator
from .ops import (alike, byte_view, contiguous, copy_back, fold, in_order, only,
                        per_element, premultiplied, reduce_view, reduction, row_splits,
                        sparse_sum)
from ..errors import CommError
from ..transports.mpi_world import allgather
from .work import DoneWork, TorchWork, dist_error

BACKEND = "commlib"

# --------------------------------------------------------------------------- bootstrap

def init_process_group(backend: str = BACKEND, timeout: timedelta | None = None, **kwargs):
    """``torch.distributed.init_process_group`` with rank, world size and store from MPI.

    Rank 0 serves a TCPStore (on a free port it broadcasts over MPI); torch uses the store
    for its own bookkeeping and for any gloo groups created alongside. Under torchrun
    (no MPI world) torch's own environment settings are used instead. Extra keyword
    arguments go to torch (``backend`` may also be e.g. "cpu:commlib,cuda:nccl").
    """
    world = MPI.COMM_WORLD
    if world.size == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun: it set RANK, WORLD_SIZE and the store's address; the ranks meet there
        dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}), **kwargs)
        return
    store = _mpi_store(world, timeout or timedelta(minutes=5))
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                            **kwargs)


def _mpi_store(world: MPI.Comm, timeout: timedelta) -> dist.TCPStore:
    # Ranks that all run on rank 0's machine reach it over loopback, and the store listens
    # on loopback only (torch's own binds every interface: it gets a socket bound here);
    # otherwise by name.
    hosts = allgather(world, socket.gethostname())
    host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    port = None
    if world.rank == 0:  # port 0: the OS picks a free port; workers learn it over MPI
        listener = None
        if host == "127.0.0.1":
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((host, 0))
            listener.listen(world.size)
        store = dist.TCPStore(host, listener.getsockname()[1] if listener else 0, world.size,
                              is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach() if listener else None)
        port = store.port
    port = allgather(world, port)[0]
    if world.rank != 0:
        store = dist.TCPStore(host, port, world.size, is_master=False, timeout=timeout)
    return store


def _create(opts, backend_options=None) -> "ProcessGroupCommlib":
    """torch's creator hook (extended API). torch calls it only on the group's members, so
    subgroups use MPI_Comm_create_group, which is collective over the members alone (or,
    without MPI, the group's own store)."""
    world = MPI.COMM_WORLD
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("commlib backend needs MPI_THREAD_MULTIPLE; MPI was initialised "
                           "with a lower thread level before commlib was imported")
    ranks = list(opts.global_ranks_in_group)
    world_size = opts.group_size if not ranks else dist.get_world_size()
    if world.size == 1 and world_size > 1:  # no MPI world (torchrun): meet through the store
        comm = Communicator.from_store(opts.store, opts.group_rank, opts.group_size,
                                       f"commlib/{opts.group_id}")
        return ProcessGroupCommlib(comm, str(opts.group_id), opts.timeout)
    if not ranks:  # the default group
        _check_world(world, opts.group_rank, opts.group_size, collective=True)
        mpi = world
    else:
        _check_world(world, dist.get_rank(), dist.get_world_size())
        group = world.Get_group().Incl(ranks)
        # The tag keeps concurrent creations apart; all members derive it from the name
        # torch gave the group, which every rank agrees on.
        mpi = world.Create_group(group, _tag(str(opts.group_id)))
        group.Free()
    comm = Communicator(mpi)  # private duplicates: torch traffic never meets the user's
    if mpi is world:  # (collective: every rank of the job is past MPI_Init and has mapped it)
        abort.unlink_mpich_segments()  # so a rank killed from now on leaves nothing behind
    abort.install()  # an uncaught exception on any rank ends the job (commlib/abort.py)
    if (comm.rank, comm.size) != (opts.group_rank, opts.group_size):
        raise RuntimeError(f"commlib backend: torch's group rank {opts.group_rank} of "
                           f"{opts.group_size} is rank {comm.rank} of {comm.size} in MPI")
    return ProcessGroupCommlib(comm, str(opts.group_id), opts.timeout, owns_mpi=mpi is not world)


def _check_world(world: MPI.Comm, rank: int, size: int, collective: bool = False) -> None:
    """torch's rank and size must be MPI.COMM_WORLD's. ``collective``: all of the world is
    here (creating the default group), so agree on the verdict first: a rank whose own
    numbers happen to match must not go on into a collective that the others left."""
    if size != world.size:
        raise RuntimeError(f"commlib backend: torch's world size {size} is not MPI.COMM_WORLD's "
                           f"size {world.size}; launch with `mpiexec -n {size}`")
    ranks = allgather(world, rank) if collective else None
    if rank != world.rank or (ranks is not None and ranks != list(range(size))):
        listed = f"torch's ranks, by MPI rank, are {ranks}" if ranks else \
            f"torch's rank {rank} is MPI rank {world.rank}"
        raise RuntimeError(
            f"commlib backend: {listed}: they must match MPI.COMM_WORLD's; pass "
            "rank=MPI.COMM_WORLD.rank and world_size=MPI.COMM_WORLD.size, or call "
            "commlib.torch.init_process_group()")


def _tag(name: str) -> int:
    return zlib.crc32(name.encode()) % 32768


# --------------------------------------------------------------------------- the process group

_trace_hook = None


def _cuda_tensors(args) -> list:
    """The CUDA tensors among ``args`` (tensors, and lists of them to any depth)."""
    found, todo = [], list(args)
    while todo:
        a = todo.pop()
        if isinstance(a, torch.Tensor):
            if a.is_cuda:
                found.append(a)
        elif isinstance(a, (list, tuple)):
            todo.extend(a)
    return found[::-1]


def _stream_ordered(op):
    """An op on CUDA tensors runs as NCCL's do under torch: on the group's stream for their
    device, made to wait for the caller's current stream, returning at once. Inside, every
    commlib call and finish step is enqueued on that stream (it is the current one there);
    the Work records an event after them, which wait() makes the caller's stream wait for.
    The tensors are marked as used on that stream, so that the caching allocator does not
    hand their memory out again before the op is over."""
    @functools.wraps(op)
    def run(self, *args, **kwargs):
        tensors = _cuda_tensors(args)
        if not tensors:
            return op(self, *args, **kwargs)
        device = tensors[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            work = op(self, *args, **kwargs)
            for t in tensors:
                t.record_stream(stream)
            work.end_on(stream)
        return work
    return run


def _at_once_first(collective: str, what: str, reduces=False, rooted=False, single=False):
    """An op's one entry: a synchronous call that commlib's fast path takes runs there to
    its end (ProcessGroupCommlib._ran_at_once); the rest runs the op as written, on the
    group's stream for CUDA tensors (_stream_ordered), which also raises what is wrong
    with them. The op takes (tensors, opts), a list of one tensor, or with ``single``
    (output, input, opts); ``what``: torch's name for it."""
    def wrap(op):
        general = _stream_ordered(op)
        if single:
            def run(self, output, input, opts=None):
                if self._ran_at_once(opts, collective, output, input, reduces, rooted):
                    return self._done(what, [output])
                return general(self, output, input, opts)
        else:
            def run(self, tensors, opts=None):
                if len(tensors) == 1 and self._ran_at_once(opts, collective, tensors[0], None,
                                                           reduces, rooted):
                    return self._done(what, tensors)
                return general(self, tensors, opts)
        return functools.wraps(op)(run)
    return wrap


def set_trace_hook(fn) -> None:
    """Call ``fn(group, op_name, work)`` whenever a commlib group issues an op (None: stop).
    For tests and debugging: it runs on the issuing thread, so keep it cheap."""
    global _trace_hook
    _trace_hook = fn


class ProcessGroupCommlib(dist.ProcessGroup):
    """torch ProcessGroup over a commlib Communicator.

    Every method stages its tensors into contiguous buffers (only when they are not
    already), issues commlib collectives - async when torch asked for async_op, else run
    to completion at once - and returns a TorchWork whose finish step copies results back
    (and which keeps staged inputs alive until the op completes).
    Ops issued on one group complete in issue order (commlib runs a communicator's
    collectives in order), as torch expects.
    """

    def __init__(self, comm: Communicator, group_name: str = "", timeout: timedelta | None = None,
                 owns_mpi: bool = False):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._group_name = group_name
        self._group_desc = ""
        self._timeout = timeout  # what wait() without a timeout waits at most, like gloo
        if timeout:  # ... and what each collective may wait for its peers, like NCCL's
            comm.timeout = timeout.total_seconds()
        self._owns_mpi = owns_mpi  # created for this group: freed with it
        self._streams: dict = {}  # device -> the stream its ops run on (_stream_ordered)

    # torch's bookkeeping getters and setters (a Python ProcessGroup must provide them)
    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self):
        return f"<ProcessGroupCommlib {self._group_name!r} rank {self.rank()} of {self.size()}>"

    def shutdown(self) -> None:
        """destroy_process_group: finish queued work, release the MPI communicators."""
        if self.comm is None:
            return
        self.comm.free()
        if self._owns_mpi:
            self.comm.mpi.Free()
        self.comm = None

    def abort(self) -> None:
        """End the group on this rank now, without its peers (after a failure: some may be
        dead): queued ops fail, nothing waits for another rank (Communicator.abort). A new
        group over the survivors then forms through torch's store, as torchft's
        reconfigurable groups do (commlib/torch/ft.py)."""
        if self.comm is None:
            return
        self.comm.abort()
        self.comm = None

    # plumbing
    def _issue(self, async_op: bool, fn, *args, **kwargs) -> list:
        """Run one commlib call: queued (returns [its Work]) or to completion now ([]).
        A call on CUDA tensors is enqueued on the current stream (_stream_ordered) and
        returns at once: it is never queued. Under torch.profiler it is a
        ``commlib:<collective>`` event (its issue, or the whole call when not async)."""
        if _profiler_enabled():  # named in torch.profiler's traces, as NCCL's calls are
            with torch.profiler.record_function(f"commlib:{fn.__name__}"):
                return self._issue_now(async_op, fn, *args, **kwargs)
        return self._issue_now(async_op, fn, *args, **kwargs)

    @staticmethod
    def _issue_now(async_op: bool, fn, *args, **kwargs) -> list:
        try:
            if async_op and not any(getattr(a, "is_cuda", False) for a in args):
                return [fn(*args, async_op=True, **kwargs)]
            fn(*args, **kwargs)
        except CommError as e:  # raised as torch reports backend failures
            raise dist_error(e) from e
        return []

    def _work(self, what, works, outputs, finish=None, keep=()) -> TorchWork:
        return self._traced(what, TorchWork(what, works, outputs, finish, self._timeout, keep))

    def _ran_at_once(self, opts, collective, output, input=None, reduces=False,
                     rooted=False) -> bool:
        """Whether a synchronous op ran to its end in commlib's fast path (Communicator.
        try_fast), which takes contiguous CPU tensors of commlib's dtypes and torch's
        ReduceOps in one C++ call once it has seen the call. The op's general route takes
        the rest (and profiled calls, which it names), and raises what is wrong with them.
        ``reduces``: the op reduces by opts.reduceOp; ``rooted``: it has opts.rootRank."""
        if opts is None or opts.asyncOp or _profiler_enabled():
            return False
        try:
            return self.comm.try_fast(collective, output, input,
                                      opts.reduceOp if reduces else None,
                                      opts.rootRank if rooted else None)
        except CommError as e:  # raised as torch reports backend failures
            raise dist_error(e) from e

    def _done(self, what, outputs) -> DoneWork | None:
        """What an op that ran at once returns: None, which torch's frontends (the only
        callers that ask for a synchronous op) take as "ran to its end, nothing to wait
        for" -- a Work costs more than a small all-reduce; a DoneWork when traced."""
        if _trace_hook is None:
            return None
        return self._traced(what, DoneWork(what, outputs))

    def _traced(self, what, work):
        if _trace_hook is not None:
            _trace_hook(self, what, work)
        return work

    # reductions
    @_at_once_first("all_reduce", "allreduce", reduces=True)
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        t = only(tensors, "allreduce")
        if t.is_sparse:
            return self._sparse_all_reduce(t, opts.reduceOp)
        works, finish = self._all_reduce(t, opts.reduceOp, opts.asyncOp, "allreduce")
        return self._work("allreduce", works, [t], finish)

    def _sparse_all_reduce(self, t, reduce_op):
        """Sparse COO tensors sum (gloo's sparse all-reduce), here before returning."""
        if reduce_op.op != dist.ReduceOp.SUM:
            raise ValueError(f"commlib backend: a sparse all_reduce sums only (as gloo's), "
                             f"got {reduce_op.op}; densify the tensor for other ops")
        if t.is_cuda:
            raise ValueError("commlib backend: sparse all_reduce takes CPU tensors; move it "
                             "to the CPU or densify it")
        try:
            t.copy_(sparse_sum(self.comm.all_gather, t, self.size()))
        except CommError as e:
            raise dist_error(e) from e
        return self._work("allreduce", [], [t])

    @_stream_ordered
    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        if not tensors:
            return self._work("allreduce_coalesced", [], [])
        # One flat buffer, one collective: what coalescing is for.
        flat = torch.cat([t.reshape(-1) for t in tensors])
        works, finish = self._all_reduce(flat, opts.reduceOp, opts.asyncOp, "allreduce_coalesced")
        pieces = flat.split([t.numel() for t in tensors])
        return self._work("allreduce_coalesced", works, list(tensors),
                          in_order(finish, copy_back(list(zip(tensors, pieces)))))

    def _all_reduce(self, t, reduce_op, async_op, what):
        op = reduction(reduce_op, t.dtype, what)
        scaled = premultiplied(reduce_op, t, what)  # (t is the input and the result)
        c = contiguous(t) if scaled is None else scaled
        wire = reduce_view(c)
        if callable(op):  # (bool's xor) every rank gets every rank's data and folds it
            rows = wire.new_empty((self.size(), wire.numel()))
            works = self._issue(async_op, self.comm.all_gather, rows, wire)
            fold_rows = lambda: wire.copy_(fold(op, rows))  # noqa: E731
            return works, in_order(fold_rows, copy_back([(t, c)]))
        works = self._issue(async_op, self.comm.all_reduce, wire, op)
        return works, copy_back([(t, c)])

    @_stream_ordered
    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        t = only(tensors, "reduce")
        op = reduction(opts.reduceOp, t.dtype, "reduce")
        root = opts.rootRank
        scaled = premultiplied(opts.reduceOp, t, "reduce")
        c = contiguous(t) if scaled is None else scaled
        wire = reduce_view(c)
        if callable(op):  # (bool's xor) gather everything, only the root folds
            rows = wire.new_empty((self.size(), wire.numel()))
            works = self._issue(opts.asyncOp, self.comm.all_gather, rows, wire)
            fold_rows = (lambda: wire.copy_(fold(op, rows))) if self.rank() == root else None
            return self._work("reduce", works, [t], in_order(fold_rows, copy_back([(t, c)])))
        works = self._issue(opts.asyncOp, self.comm.reduce, wire, root, op)
        # (elsewhere than the root, t stays as it was: a premultiplied copy is not copied back)
        back = copy_back([(t, c)]) if scaled is None or self.rank() == root else None
        return self._work("reduce", works, [t], back)

    @_stream_ordered
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out = only(output_tensors, "reduce_scatter")
        inputs = only(input_tensors, "reduce_scatter")
        if len(inputs) != self.size():
            raise ValueError(f"commlib backend: reduce_scatter needs {self.size()} input "
                             f"tensors, got {len(inputs)}")
        alike(inputs, out, "reduce_scatter input")
        flat = torch.cat([x.reshape(-1) for x in inputs])
        works, finish = self._reduce_scatter(out, flat, opts, "reduce_scatter")
        return self._work("reduce_scatter", works, [out], finish, keep=flat)

    @_at_once_first("reduce_scatter", "reduce_scatter_tensor", reduces=True, single=True)
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        inp = contiguous(input)
        works, finish = self._reduce_scatter(output, inp, opts, "reduce_scatter_tensor")
        return self._work("reduce_scatter_tensor", works, [output], finish, keep=inp)

    @_stream_ordered
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()

        def one(out, inp, _async_op):  # opts carries asyncOp
            return self._reduce_scatter(out, inp, opts, "reduce_scatter_coalesced")
        return self._coalesced("reduce_scatter_coalesced", one, outputs, inputs, opts.asyncOp,
                               list(outputs))

    def _reduce_scatter(self, out, inp, opts, what):
        """``inp`` is contiguous with size * out.numel() elements."""
        op = reduction(opts.reduceOp, out.dtype, what)
        scaled = premultiplied(opts.reduceOp, inp, what)
        inp = inp if scaled is None else scaled
        c = contiguous(out)
        wire_out, wire_in = reduce_view(c), reduce_view(inp)
        if callable(op):  # bitwise: rank r receives block r of every rank, then folds
            rows = wire_out.new_empty((self.size(), wire_out.numel()))
            works = self._issue(opts.asyncOp, self.comm.all_to_all, rows, wire_in)
            fold_rows = lambda: wire_out.copy_(fold(op, rows))  # noqa: E731
            return works, in_order(fold_rows, copy_back([(out, c)]))
        works = self._issue(opts.asyncOp, self.comm.reduce_scatter, wire_out, wire_in, op)
        return works, copy_back([(out, c)])

    # data movement
    @_at_once_first("broadcast", "broadcast", rooted=True)
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        t = tensors[opts.rootTensor]
        c = contiguous(t)
        works = self._issue(opts.asyncOp, self.comm.broadcast, byte_view(c), opts.rootRank)
        return self._work("broadcast", works, list(tensors), copy_back([(t, c)]))

    @_stream_ordered
    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        outs = only(output_tensors, "allgather")
        inp = contiguous(only(input_tensors, "allgather"))
        works, finish = self._all_gather_list(outs, inp, opts.asyncOp)
        return self._work("allgather", works, list(outs), finish, keep=inp)

    @_stream_ordered
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``: one list per rank."""
        opts = opts or dist.AllgatherOptions()
        if len(output_lists) != self.size() or any(len(outs) != len(input_list)
                                                   for outs in output_lists):
            raise ValueError(
                f"commlib backend: allgather_coalesced needs {self.size()} output lists (one "
                f"per rank) of {len(input_list)} tensors (one per input), got lists of "
                f"{[len(outs) for outs in output_lists]}")
        per_input = [list(outs) for outs in zip(*output_lists)] if input_list else []
        return self._coalesced("allgather_coalesced", self._all_gather_list, per_input,
                               input_list, opts.asyncOp, [t for outs in output_lists for t in outs])

    def _coalesced(self, name, one, outputs, inputs, async_op, results):
        """Issue ``one(output, contiguous input, async_op)`` for each pair; one Work for all."""
        works, finishes, staged = [], [], [contiguous(inp) for inp in inputs]
        for out, inp in zip(outputs, staged, strict=True):
            w, f = one(out, inp, async_op)
            works += w
            finishes.append(f)
        return self._work(name, works, results, in_order(*finishes), keep=staged)

    def _all_gather_list(self, outs, inp, async_op):
        """``inp`` is contiguous."""
        if len(outs) != self.size():
            raise ValueError(f"commlib backend: allgather needs {self.size()} output tensors, "
                             f"got {len(outs)}")
        alike(outs, inp, "allgather output")
        rows = inp.new_empty((self.size(),) + inp.shape)
        works = self._issue(async_op, self.comm.all_gather, byte_view(rows), byte_view(inp))
        return works, copy_back(list(zip(outs, rows)))

    @_at_once_first("all_gather", "all_gather_into_tensor", single=True)
    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        inp = contiguous(input)
        works, finish = self._all_gather_single(output, inp, opts.asyncOp)
        return self._work("all_gather_into_tensor", works, [output], finish, keep=inp)

    @_stream_ordered
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._coalesced("all_gather_into_tensor_coalesced", self._all_gather_single,
                               outputs, inputs, opts.asyncOp, list(outputs))

    def _all_gather_single(self, output, inp, async_op):
        """``inp`` is contiguous."""
        c = contiguous(output)
        works = self._issue(async_op, self.comm.all_gather, byte_view(c), byte_view(inp))
        return works, copy_back([(output, c)])

    @_stream_ordered
    def gather(self, output_tensors, input_tensors, opts=None):
        """An all_to_all where every rank sends only to the root: one transfer per rank."""
        opts = opts or dist.GatherOptions()
        root, size = opts.rootRank, self.size()
        inp = contiguous(only(input_tensors, "gather"))
        n = byte_view(inp).numel()
        at_root = self.rank() == root
        outs = output_tensors[0] if at_root else []
        if at_root and len(outs) != size:
            raise ValueError(f"commlib backend: gather needs {size} output tensors on the "
                             f"root, got {len(outs)}")
        alike(outs, inp, "gather output")
        rows = inp.new_empty(((size,) if at_root else (0,)) + inp.shape)
        works = self._issue(opts.asyncOp, self.comm.all_to_all, byte_view(rows), byte_view(inp),
                            [n if at_root else 0] * size,
                            [n if r == root else 0 for r in range(size)])
        return self._work("gather", works, list(outs), copy_back(list(zip(outs, rows))),
                          keep=inp)

    @_stream_ordered
    def scatter(self, output_tensors, input_tensors, opts=None):
        """An all_to_all where only the root sends: block r to rank r."""
        opts = opts or dist.ScatterOptions()
        root, size = opts.rootRank, self.size()
        out = only(output_tensors, "scatter")
        c = contiguous(out)
        n = byte_view(c).numel()
        at_root = self.rank() == root
        if at_root:
            pieces = only(input_tensors, "scatter")
            if len(pieces) != size:
                raise ValueError(f"commlib backend: scatter needs {size} input tensors on the "
                                 f"root, got {len(pieces)}")
            alike(pieces, out, "scatter input")
            flat = torch.cat([byte_view(contiguous(p)) for p in pieces])
        else:
            flat = byte_view(c).new_empty(0)
        works = self._issue(opts.asyncOp, self.comm.all_to_all, byte_view(c), flat,
                            [n if r == root else 0 for r in range(size)],
                            [n if at_root else 0] * size)
        return self._work("scatter", works, [out], copy_back([(out, c)]), keep=flat)

    @_stream_ordered
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """Splits count dim-0 rows (torch) and become element counts (commlib)."""
        opts = opts or dist.AllToAllOptions()
        c_out, c_in = contiguous(output), contiguous(input)
        out_b, in_b = byte_view(c_out), byte_view(c_in)
        works = self._issue(opts.asyncOp, self.comm.all_to_all, out_b, in_b,
                            row_splits(output_split_sizes, c_out, out_b),
                            row_splits(input_split_sizes, c_in, in_b))
        return self._work("all_to_all_single", works, [output], copy_back([(output, c_out)]),
                          keep=c_in)

    @_stream_ordered
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """The list form: one flat buffer each way, split per peer."""
        opts = opts or dist.AllToAllOptions()
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(f"commlib backend: all_to_all needs {self.size()} input and output "
                             f"tensors, got {len(input_tensors)} and {len(output_tensors)}")
        dtype = output_tensors[0].dtype
        for i, t in enumerate(list(output_tensors) + list(input_tensors)):
            if t.dtype != dtype:
                raise ValueError(f"commlib backend: all_to_all takes one dtype; tensor {i} of "
                                 f"outputs + inputs is {t.dtype}, the first output {dtype}")
        flat_in = torch.cat([byte_view(contiguous(t)) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype,
                               device=output_tensors[0].device)
        k = per_element(dtype)
        works = self._issue(opts.asyncOp, self.comm.all_to_all, byte_view(flat_out), flat_in,
                            [t.numel() * k for t in output_tensors],
                            [t.numel() * per_element(t.dtype) for t in input_tensors])
        pieces = flat_out.split([t.numel() for t in output_tensors])
        return self._work("all_to_all", works, list(output_tensors),
                          copy_back(list(zip(output_tensors, pieces))), keep=flat_in)

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._work("barrier", self._issue(opts.asyncOp, self.comm.barrier), [])

    # point to point: always posted at once (MPI Isend/Irecv), completed by commlib's poller
    @_stream_ordered
    def send(self, tensors, dst, tag):
        t = contiguous(only(tensors, "send"))
        work = self.comm.send(byte_view(t), dst, tag, async_op=True)
        return self._work("send", [work], list(tensors), keep=t)

    @_stream_ordered
    def recv(self, tensors, src, tag):
        t = only(tensors, "recv")
        if t.is_cuda and not t.is_contiguous():  # a copy back would run off the stream
            raise ValueError("commlib backend: recv into a non-contiguous CUDA tensor; "
                             "receive into a contiguous one and copy")
        c = contiguous(t)
        work = self.comm.recv(byte_view(c), src, tag, async_op=True)
        if t.is_cuda:
            work.wait()  # this stream waits for the message's copy to the device
        return self._work("recv", [work], list(tensors), copy_back([(t, c)]))

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, None, tag)  # (the Work's _source_rank() says from whom)

    # Older names torch's Python code or user code may still call.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
