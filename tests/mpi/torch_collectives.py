"""torch.distributed collectives on the "commlib" backend give what gloo gives, inside the
same processes (default group commlib, a gloo group over the same ranks beside it).
Also: subgroups, a 2-D device mesh (4 ranks), async ops that really run in the
background, wait() timeouts, p2p, object collectives, and clear errors. Under mpiexec."""
import os
import socket
import time
import warnings
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

import commlib.torch.backend as tb
from commlib import settings
from commlib.torch.work import TorchWork
from harness import Checker, raises

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames collectives
tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
WORLD = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
HOSTS = [None] * n  # each rank's host: which transport each group must get
dist.all_gather_object(HOSTS, socket.gethostname(), group=GLOO)
R = dist.ReduceOp
check = Checker()
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def data(shape, dtype, salt=0, who=None, op=None):
    """Deterministic per-rank values whose reductions are exact in every dtype, <= 4 ranks."""
    who = rank if who is None else who
    g = torch.Generator().manual_seed(1000 * salt + who)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if op == R.PRODUCT:
        table = torch.tensor([1, 2, 1] if dtype == torch.uint8 else [-1, 1, 2])
        return table[torch.randint(0, 3, shape, generator=g)].to(dtype)
    if op in (R.BAND, R.BOR, R.BXOR):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -4
    x = torch.randint(low, low + 9, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(x.float(), -x.float())
    return x.to(dtype)


def same(got, want, tol=0.0, path="result"):
    """Same types, shapes, dtypes and values (values within ``tol`` relative if given)."""
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: {len(got)} items, gloo {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, tol, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{path}: {got.dtype}{list(got.shape)} vs gloo {want.dtype}{list(want.shape)}"
        ok = torch.allclose(got, want, rtol=tol, atol=0) if tol else torch.equal(got, want)
        assert ok, (f"{path}: commlib {got.flatten()[:8].tolist()} "
                    f"gloo {want.flatten()[:8].tolist()}")
    else:
        assert got == want, f"{path}: commlib {got!r}, gloo {want!r}"


def versus_gloo(name, fn, ours=WORLD, theirs=GLOO, tol=0.0):
    """Case ``name``: fn(group, async_op) on commlib and on gloo must agree, sync and async."""
    def run():
        # Every rank issues everything before comparing, so a mismatch cannot desynchronize.
        results = [(fn(ours, a), fn(theirs, a), a) for a in (False, True)]
        for got, want, a in results:
            same(got, want, tol, f"{name} async={a}")
    check.check(name, run)


def finish(work, async_op):
    if async_op and isinstance(work, torch._C.Future):  # all_reduce_coalesced returns one
        work.wait()
    elif async_op:
        assert work is not None and work.wait(timedelta(seconds=60))
    return work


def pow2(k):
    return k & (k - 1) == 0


# ---------------------------------------------------------------- reductions

def reductions(ours=WORLD, theirs=GLOO, tag=""):
    size = dist.get_world_size(ours)
    avg_tol = 0.0 if pow2(size) else 1e-6  # x * (1/3) may round unlike x / 3
    for dtype in FLOATS + INTS + [torch.bool]:
        ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
        ops += [R.AVG] if dtype.is_floating_point else [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            def all_reduce(g, a, dtype=dtype, op=op):
                t = data((5, 7), dtype, 1, op=op)
                finish(dist.all_reduce(t, op, group=g, async_op=a), a)
                return t

            def reduce(g, a, dtype=dtype, op=op):
                t = data((33,), dtype, 2, op=op)
                root = dist.get_global_rank(g, dist.get_world_size(g) - 1)
                finish(dist.reduce(t, root, op, group=g, async_op=a), a)
                return t if rank == root else None  # elsewhere gloo leaves scratch data

            def reduce_scatter(g, a, dtype=dtype, op=op):
                k = dist.get_world_size(g)
                ins = [data((3, 2), dtype, 3 + i, op=op) for i in range(k)]
                out = torch.zeros((3, 2), dtype=dtype)
                finish(dist.reduce_scatter(out, ins, op, group=g, async_op=a), a)
                return out

            def reduce_scatter_tensor(g, a, dtype=dtype, op=op):
                k = dist.get_world_size(g)
                inp, out = data((4 * k, 3), dtype, 4, op=op), torch.zeros((4, 3), dtype=dtype)
                finish(dist.reduce_scatter_tensor(out, inp, op, group=g, async_op=a), a)
                return out

            tol = avg_tol if op == R.AVG else 0.0
            label = f"{tag}{str(dtype)[6:]}-{str(op)[10:]}"
            for fn in (all_reduce, reduce, reduce_scatter, reduce_scatter_tensor):
                versus_gloo(f"{fn.__name__}-{label}", fn, ours, theirs, tol)


def reduction_extras():
    def complex_sum(g, a):
        t = data((6,), torch.complex64, 5)
        finish(dist.all_reduce(t, group=g, async_op=a), a)
        return t

    def coalesced(g, a):
        ts = [data((3,), torch.float32, 9), data((2, 2), torch.float32, 10)]
        finish(dist.all_reduce_coalesced(ts, group=g, async_op=a), a)
        return ts

    def empty(g, a):
        t = torch.zeros(0)
        finish(dist.all_reduce(t, group=g, async_op=a), a)
        return t

    def coalescing(collective, out_elems, in_elems):
        """Two calls under the coalescing manager (which calls the *_coalesced methods)."""
        def fn(g, a):
            k = dist.get_world_size(g)
            outs = [torch.zeros(out_elems(k, m)) for m in (3, 2)]
            ins = [data((in_elems(k, m),), torch.float32, 11 + m) for m in (3, 2)]
            with dist._coalescing_manager(group=g, async_ops=a) as cm:
                for o, i in zip(outs, ins):
                    collective(o, i, group=g)
            if a:
                cm.wait()
            return outs
        return fn

    versus_gloo("all_reduce-complex", complex_sum)
    versus_gloo("all_reduce_coalesced", coalesced)
    versus_gloo("all_gather_into_tensor_coalesced", coalescing(
        dist.all_gather_into_tensor, lambda k, m: k * m, lambda k, m: m))
    versus_gloo("reduce_scatter_tensor_coalesced", coalescing(
        dist.reduce_scatter_tensor, lambda k, m: m, lambda k, m: k * m))
    versus_gloo("all_reduce-empty", empty)


# ---------------------------------------------------------------- data movement

def movement(ours=WORLD, theirs=GLOO, tag=""):
    k = dist.get_world_size(ours)
    last = dist.get_global_rank(ours, k - 1)
    me = dist.get_rank(ours)
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                  torch.complex64]:
        def broadcast(g, a, dtype=dtype):
            t = data((4, 5), dtype, 11)
            finish(dist.broadcast(t, last, group=g, async_op=a), a)
            return t

        def all_gather(g, a, dtype=dtype):
            outs = [torch.zeros((2, 3), dtype=dtype) for _ in range(k)]
            finish(dist.all_gather(outs, data((2, 3), dtype, 13), group=g, async_op=a), a)
            return outs

        def all_gather_into_tensor(g, a, dtype=dtype):
            out = torch.zeros((3 * k, 2), dtype=dtype)
            finish(dist.all_gather_into_tensor(out, data((3, 2), dtype, 14), group=g,
                                               async_op=a), a)
            return out

        def all_to_all_single(g, a, dtype=dtype):
            even_in, even_out = data((2 * k, 3), dtype, 15), torch.zeros((2 * k, 3), dtype=dtype)
            finish(dist.all_to_all_single(even_out, even_in, group=g, async_op=a), a)
            # uneven: rank i sends i + j + 1 rows to rank j
            ins = [me + j + 1 for j in range(k)]
            outs = [j + me + 1 for j in range(k)]
            inp, out = data((sum(ins), 2), dtype, 16), torch.zeros((sum(outs), 2), dtype=dtype)
            finish(dist.all_to_all_single(out, inp, outs, ins, group=g, async_op=a), a)
            return even_out, out

        def all_to_all(g, a, dtype=dtype):  # gloo takes equal sizes only
            ins = [data((2,), dtype, 17 + j) for j in range(k)]
            outs = [torch.zeros((2,), dtype=dtype) for j in range(k)]
            finish(dist.all_to_all(outs, ins, group=g, async_op=a), a)
            return outs

        def gather(g, a, dtype=dtype):
            results = []
            for dst in (dist.get_global_rank(g, 0), last):
                out = [torch.zeros((2, 2), dtype=dtype) for _ in range(k)] \
                    if dist.get_rank() == dst else None
                finish(dist.gather(data((2, 2), dtype, 18), out, dst, group=g, async_op=a), a)
                results.append(out or [])
            return results

        def scatter(g, a, dtype=dtype):
            results = []
            for src in (dist.get_global_rank(g, 0), last):
                pieces = [data((3,), dtype, 19 + i) for i in range(k)] \
                    if dist.get_rank() == src else None
                out = torch.zeros(3, dtype=dtype)
                finish(dist.scatter(out, pieces, src, group=g, async_op=a), a)
                results.append(out)
            return results

        for fn in (broadcast, all_gather, all_gather_into_tensor, all_to_all_single, all_to_all,
                   gather, scatter):
            if fn is gather and dtype.is_complex:
                continue  # gloo cannot gather complex (commlib can: see beyond_gloo)
            versus_gloo(f"{tag}{fn.__name__}-{str(dtype)[6:]}", fn, ours, theirs)


def sparse():
    """Sparse COO all_reduce sums as gloo's does (DDP with sparse embedding gradients):
    entries each rank holds (some shared, some its own, duplicates uncoalesced)."""
    def all_reduce(g, a):
        indices = torch.tensor([[0, rank % 3, 2 + rank, 2 + rank], [1, 0, rank, rank]])
        values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.5, 0.5]]) * (rank + 1)
        t = torch.sparse_coo_tensor(indices, values, (n + 3, n + 1, 2), check_invariants=True)
        finish(dist.all_reduce(t, group=g, async_op=a), a)
        return t.to_dense()
    versus_gloo("sparse_all_reduce", all_reduce)
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,),
                                check_invariants=True)
    raises(ValueError, "sums only", lambda: dist.all_reduce(t, dist.ReduceOp.MAX))


def list_layouts():
    """Ops whose arguments are lists of lists: all_gather_coalesced (output_lists[r][i] is
    rank r's input i) with 1, 2 and world-size inputs of different shapes, against gloo (at
    world-size inputs a transposed pairing looks plausible); and list entries that do not
    match refused, not reshaped or converted."""
    k = n
    for count in sorted({1, 2, k}):
        for dtype, shapes in ((torch.float32, [(3,), (2, 2), (1,), (4, 1)]),
                              (torch.int64, [(2,)] * 4)):
            def all_gather_coalesced(g, a, count=count, dtype=dtype, shapes=shapes):
                ins = [data(shapes[i], dtype, 30 + i) for i in range(count)]
                outs = [[torch.zeros(shapes[i], dtype=dtype) for i in range(count)]
                        for _ in range(k)]
                finish(dist.all_gather_coalesced(outs, ins, group=g, async_op=a), a)
                return outs
            versus_gloo(f"all_gather_coalesced-{count}-{str(dtype)[6:]}", all_gather_coalesced)

    def refused():
        raises(ValueError, "does not match torch.float32[3]",
               lambda: dist.all_gather([torch.zeros(4)] * k, torch.ones(3)))
        raises(ValueError, "output lists", lambda: dist.all_gather_coalesced(
            [[torch.zeros(3)]] * (k + 1), [torch.ones(3)]))
        raises(ValueError, "does not match", lambda: dist.reduce_scatter(
            torch.zeros(3), [torch.ones(4)] * k))
        dist.barrier()
    check.check("list_layouts-refused", refused)


def beyond_gloo():
    """What gloo refuses or gets wrong, checked against each rank's known data: dtypes gloo
    cannot move (int16, complex gather), non-contiguous tensors (gloo ignores them
    silently), uneven list all_to_all (gloo takes equal sizes only)."""
    everyone = range(n)

    def expect(got, want):
        same(got, want, path="beyond_gloo")

    for dtype in (torch.int16, torch.complex64):
        out = [torch.zeros((2, 3), dtype=dtype) for _ in everyone] if rank == n - 1 else None
        dist.gather(data((2, 3), dtype, 50), out, n - 1)
        if rank == n - 1:
            expect(out, [data((2, 3), dtype, 50, who=r) for r in everyone])
        t = data((5,), dtype, 51)
        dist.broadcast(t, 0)
        expect(t, data((5,), dtype, 51, who=0))
        whole = torch.zeros((2 * n, 3), dtype=dtype)
        dist.all_gather_into_tensor(whole, data((2, 3), dtype, 52))
        expect(whole, torch.cat([data((2, 3), dtype, 52, who=r) for r in everyone]))

    # non-contiguous in-place, input and output tensors
    t = data((6, 4), torch.float32, 53).t()
    dist.all_reduce(t, R.MAX, async_op=True).wait()
    expect(t, torch.stack([data((6, 4), torch.float32, 53, who=r) for r in everyone])
           .amax(0).t())
    u = data((9,), torch.int64, 54)[::3]
    dist.broadcast(u, n - 1)
    expect(u, data((9,), torch.int64, 54, who=n - 1)[::3])
    outs = [torch.zeros((3, 2)).t() for _ in everyone]
    dist.all_gather(outs, data((4, 3), torch.float32, 55)[::2])
    expect(outs, [data((4, 3), torch.float32, 55, who=r)[::2] for r in everyone])
    rs = torch.zeros((5, 8))[:, ::2]
    dist.reduce_scatter_tensor(rs, data((5 * n, 8), torch.float32, 56)[:, 1::2])
    want = sum(data((5 * n, 8), torch.float32, 56, who=r)[:, 1::2] for r in everyone)
    expect(rs, want[5 * rank:5 * rank + 5])
    got = torch.zeros((4, 3)).t()
    if n > 1:
        if rank == 0:
            dist.send(data((4, 3), torch.float32, 57)[::2, :2].t(), 1)
        elif rank == 1:
            dist.recv(got[:2, :2], 0)
            expect(got[:2, :2], data((4, 3), torch.float32, 57, who=0)[::2, :2].t())

    # uneven list all_to_all: rank i sends i + j + 1 elements to rank j
    ins = [data((rank + j + 1,), torch.int64, 58 + j) for j in everyone]
    outs = [torch.zeros(j + rank + 1, dtype=torch.int64) for j in everyone]
    dist.all_to_all(outs, ins)
    expect(outs, [data((j + rank + 1,), torch.int64, 58 + rank, who=j) for j in everyone])


def objects_and_barrier():
    def objects(g, a):
        got = [None] * dist.get_world_size(g)
        dist.all_gather_object(got, {"rank": rank, "list": list(range(rank))}, group=g)
        objs = [f"from {rank}", rank * 1.5, None] if rank == 0 else [None] * 3
        dist.broadcast_object_list(objs, src=0, group=g)
        last = dist.get_global_rank(g, dist.get_world_size(g) - 1)
        gathered = [None] * dist.get_world_size(g) if rank == last else None
        dist.gather_object(("gathered", rank), gathered, dst=last, group=g)
        scattered = [None]
        pieces = [{"to": r} for r in range(dist.get_world_size(g))] if rank == last else None
        dist.scatter_object_list(scattered, pieces, src=last, group=g)
        dist.barrier(group=g)
        finish(dist.barrier(group=g, async_op=True), True)
        return got, objs, gathered, scattered
    check.check("objects_and_barrier", lambda: same(objects(WORLD, False), objects(GLOO, False)))


def profiled():
    """commlib's calls are named events in torch.profiler's trace, as NCCL's are."""
    def run():
        t = torch.ones(8)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dist.all_reduce(t)
            dist.all_gather_into_tensor(torch.empty(8 * n), t)
            dist.broadcast(t, src=0, async_op=True).wait()
        names = Counter(e.name for e in prof.events())
        for want in ("commlib:all_reduce", "commlib:all_gather", "commlib:broadcast"):
            assert names[want] >= 1, (want, sorted(k for k in names if "commlib" in k))
    check.check("profiled", run)


def synchronous_ops_run_at_once():
    """A synchronous all_reduce, broadcast, all_gather_into_tensor or reduce_scatter_tensor
    on plain CPU tensors runs in commlib's fast path once it has seen the call (one C++
    call, no Work: torch's frontend takes None; a traced op gets a done Work whose Future
    holds the outputs), with every ReduceOp it has; an op it has not, or a bitwise one on
    floats, is declined and refused as before. What the fast path declines
    (non-contiguous, bool, async) takes the general route, with gloo's results."""
    fast = WORLD.comm._calls.fast  # (white-box: which path a call took)
    if fast is None or WORLD.comm.transport != "shm":  # (elsewhere it runs fewer algorithms)
        return
    x = data((3, 5), torch.float32, who=rank)
    out, block = torch.empty(n * 15), torch.empty(15)

    def calls():
        t = x.clone()
        dist.all_reduce(t, op=R.MAX)
        b = x.clone()
        dist.broadcast(b, src=n - 1)
        dist.all_gather_into_tensor(out, x.reshape(-1))
        dist.reduce_scatter_tensor(block, torch.arange(n * 15, dtype=torch.float32) + rank)
        return t, b
    calls()  # (seen once: the general route teaches the fast path)
    taken = fast.native.taken
    t, b = calls()
    assert fast.native.taken == taken + 4, (taken, fast.native.taken)
    want_max, want_b, want_out = (x.clone() for _ in range(3))
    gloo = [want_max, want_b, torch.empty(n * 15)]
    dist.all_reduce(gloo[0], op=R.MAX, group=GLOO)
    dist.broadcast(gloo[1], src=n - 1, group=GLOO)
    dist.all_gather_into_tensor(gloo[2], x.reshape(-1), group=GLOO)
    same(t, gloo[0], path="all_reduce")
    same(b, gloo[1], path="broadcast")
    same(out, gloo[2], path="all_gather_into_tensor")
    same(block, (torch.arange(15, dtype=torch.float32) + rank * 15) * n + n * (n - 1) / 2,
         path="reduce_scatter_tensor")
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG):  # each in one C++ call
        got, want = x.clone(), x.clone()
        taken = fast.native.taken
        dist.all_reduce(got, op=op)
        assert fast.native.taken == taken + 1, op
        dist.all_reduce(want, op=op, group=GLOO)
        same(got, want, tol=1e-6, path=f"all_reduce {op}")
    taken = fast.native.taken
    raises(ValueError, "Cannot use ReduceOp.BAND with non-integral",
           lambda: dist.all_reduce(x.clone(), R.BAND))
    assert fast.native.taken == taken
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    assert WORLD.allreduce([t], opts) is None  # ran to its end: nothing to wait for
    tb.set_trace_hook(lambda group, what, work: None)
    try:
        work = WORLD.allreduce([t], opts)
    finally:
        tb.set_trace_hook(None)
    assert work.is_completed() and work.wait() and work.get_future().value()[0] is t

    strided = torch.ones(4, 6)[:, ::2]  # declined: the general route makes it contiguous
    dist.all_reduce(strided)
    same(strided, torch.full((4, 3), float(n)), path="strided")
    flags = torch.tensor([rank == 0, True])  # bool: declined, reduced as gloo's
    dist.all_reduce(flags)
    assert flags.tolist() == [True, True], flags
    work = dist.all_reduce(t, async_op=True)  # async: queued, never at once
    assert isinstance(work, TorchWork), work
    work.wait()


# ---------------------------------------------------------------- point to point

def premul_sum():
    """NCCL's PREMUL_SUM (gloo has none): every rank's input times the factor, a number or
    a one-element tensor, then summed; all_reduce, reduce (the others' tensor unchanged)
    and reduce_scatter_tensor, against the same sum made here from every rank's data."""
    inputs = [data((4, 6), torch.float64, salt=7, who=r) for r in range(n)]
    for factor in (0.5, torch.tensor([3.0]), torch.tensor(-2.0, dtype=torch.float64)):
        f = factor.item() if isinstance(factor, torch.Tensor) else factor
        want = sum(f * x for x in inputs)
        for async_op in (False, True):
            t = inputs[rank].clone()
            finish(dist.all_reduce(t, dist._make_nccl_premul_sum(factor), async_op=async_op),
                   async_op)
            same(t, want, tol=1e-12, path=f"all_reduce premul {f}")
            t = inputs[rank].clone()
            finish(dist.reduce(t, n - 1, dist._make_nccl_premul_sum(factor),
                               async_op=async_op), async_op)
            same(t, want if rank == n - 1 else inputs[rank], tol=1e-12,
                 path=f"reduce premul {f}")
            block = torch.empty(6, dtype=torch.float64)
            flat = [x.reshape(-1)[:6 * n] for x in inputs]
            given = flat[rank].clone()
            finish(dist.reduce_scatter_tensor(block, given, dist._make_nccl_premul_sum(factor),
                                              async_op=async_op), async_op)
            same(block, sum(f * x for x in flat)[6 * rank:6 * (rank + 1)], tol=1e-12,
                 path=f"reduce_scatter_tensor premul {f}")
            same(given, flat[rank], path="reduce_scatter_tensor's input (unchanged)")


def point_to_point():
    if n < 2:
        return
    nxt, prev = (rank + 1) % n, (rank - 1) % n

    def ring(g, a):
        send, got = data((3, 4), torch.float32, 20), torch.zeros((3, 4))  # gloo: contiguous only
        if a:
            works = [dist.isend(send, nxt, group=g, tag=5), dist.irecv(got, prev, group=g, tag=5)]
            for w in works:
                assert w.wait(timedelta(seconds=60))
        elif rank % 2 == 0:
            dist.send(send, nxt, group=g)
            dist.recv(got, prev, group=g)
        else:
            dist.recv(got, prev, group=g)
            dist.send(send, nxt, group=g)
        ops = [dist.P2POp(dist.irecv, b := torch.zeros(5, dtype=torch.int64), prev, g),
               dist.P2POp(dist.isend, torch.arange(5) * (rank + 1), nxt, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got, b

    versus_gloo("send_recv_isend_irecv_batch", ring)

    def from_any_source(g, a):  # every other rank sends rank 0 its number, in any order
        # A tag per round: a fast sender's next-round message must not match this round's
        # any-source receive (rank 0 would then wait on a sender blocked in gloo's send).
        tag = 8 + a
        if rank == 0:
            got = {}
            for _ in range(n - 1):
                t = torch.zeros(2, dtype=torch.int64)
                if a:
                    w = dist.irecv(t, group=g, tag=tag)
                    w.wait()
                    src = w._source_rank()
                else:
                    src = dist.recv(t, group=g, tag=tag)
                got[src] = t.tolist()
            return torch.tensor([[src, *values] for src, values in sorted(got.items())])
        dist.send(torch.tensor([rank, 10 * rank]), 0, group=g, tag=tag)
        return torch.zeros(0)

    versus_gloo("recv_from_any_source", from_any_source)


# ---------------------------------------------------------------- async, timeouts, errors

def truly_async():
    """Rank 0 issues collectives that rank 1 joins 1 s later: each call returns at once,
    the ops complete in the background without wait(), and wait() then succeeds."""
    if n < 2:
        return
    big = 1 << 20
    t = torch.full((big,), float(rank))
    gathered, scattered = torch.zeros(n * 8), torch.zeros(8)
    swapped, bcast = torch.zeros(8 * n), torch.full((8,), float(rank))
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    start = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True),
             dist.all_gather_into_tensor(gathered, torch.full((8,), float(rank)), async_op=True),
             dist.reduce_scatter_tensor(scattered, torch.ones(8 * n), async_op=True),
             dist.all_to_all_single(swapped, torch.full((8 * n,), float(rank)), async_op=True),
             dist.broadcast(bcast, 1, async_op=True)]
    issued = time.perf_counter() - start
    futures = [w.get_future() for w in works]
    if rank == 0:
        assert issued < 0.2, f"issuing async collectives blocked {issued:.3f} s"
        assert not any(w.is_completed() for w in works)
        deadline = time.time() + 30
        while not all(w.is_completed() for w in works) and time.time() < deadline:
            time.sleep(0.01)  # no wait(): the backend's threads must finish them
        assert all(w.is_completed() for w in works) and all(f.done() for f in futures)
    assert all(w.wait() and w.is_success() for w in works)
    assert futures[0].value()[0] is t
    assert torch.equal(t, torch.full((big,), n * (n - 1) / 2))
    assert torch.equal(gathered, torch.arange(n).float().repeat_interleave(8))
    assert torch.equal(scattered, torch.full((8,), float(n)))
    assert torch.equal(swapped, torch.arange(n).float().repeat_interleave(8))
    assert torch.equal(bcast, torch.ones(8))


def wait_timeout():
    """wait(timeout) raises while a peer has not issued the op; it completes afterwards."""
    if n < 2:
        return
    t = torch.ones(8)
    dist.barrier()
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(timedelta(milliseconds=200))
            raise AssertionError("wait returned before the others issued the all_reduce")
        except TimeoutError as e:
            assert " Timed out " in str(e), e  # as gloo words it: callers look for it
        for peer in range(1, n):  # now let the others go on
            dist.send(torch.zeros(1), peer)
        assert work.wait(timedelta(seconds=60))
    else:
        dist.recv(torch.zeros(1), 0)
        dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), float(n)))


def errors():
    raises(TypeError, "AVG needs a floating dtype",
           lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), R.AVG))
    raises(ValueError, "Cannot use ReduceOp.BAND with non-integral",
           lambda: dist.all_reduce(torch.ones(3), R.BAND))
    raises(TypeError, "cannot reduce torch.int16",
           lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)))
    raises(TypeError, "PREMUL_SUM needs a floating or complex dtype",
           lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32),
                                   dist._make_nccl_premul_sum(2.0)))
    if n > 1:  # a failure in the background reaches wait(), the Future and exception()
        if rank == 0:
            dist.send(torch.zeros(3), 1)
        elif rank == 1:
            work = dist.irecv(torch.zeros(5), 0)
            raises(RuntimeError, "got 12 bytes", work.wait)
            raises(RuntimeError, "got 12 bytes", work.get_future().wait)
            assert not work.is_success() and "12 bytes" in str(work.exception())
    dist.barrier()  # everyone is still in step


# ---------------------------------------------------------------- subgroups and a 2-D mesh

def expected_transport(ranks):
    """On one host shared memory; on several, hosts where each has as many of ``ranks``,
    else what joins them: TCP (net), or COMMLIB_CROSS's (mpi under mpiexec, gloo under
    torchrun)."""
    per_host = Counter(HOSTS[r] for r in ranks).values()
    if len(per_host) == 1:
        return "shm"
    if len(set(per_host)) == 1:
        return "hosts"
    return settings.get("COMMLIB_CROSS")


def is_commlib(group):
    assert dist.get_backend(group) == "commlib", dist.get_backend(group)
    assert isinstance(group, tb.ProcessGroupCommlib), repr(group)
    want = expected_transport(dist.get_process_group_ranks(group))
    assert group.comm.transport == want, (group.comm.transport, want)
    if want != "shm":  # (gloo's own collectives are there only where gloo joins the hosts)
        over_gloo = "gloo" in group.comm.algorithms("all_reduce")
        assert over_gloo == (settings.get("COMMLIB_CROSS") == "gloo"), over_gloo


def subgroups():
    """Every rank creates every group (torch's rule); members compare commlib to gloo."""
    specs = [[0, n - 1], list(range(1, n)) or [0], [r for r in range(n) if r % 2 == 0]]
    for i, ranks in enumerate(specs):
        ranks = sorted(set(ranks))
        ours, theirs = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            check.check(f"subgroup{i}-backend", lambda g=ours: is_commlib(g))
            for dtype in (torch.float32, torch.int64):
                def sub_all_reduce(g, a, dtype=dtype):
                    t = data((6,), dtype, 30)
                    finish(dist.all_reduce(t, R.SUM, group=g, async_op=a), a)
                    return t
                versus_gloo(f"sub{i}-all_reduce-{str(dtype)[6:]}", sub_all_reduce, ours, theirs)
            if i == 0:  # the full matrix once, on a group that leaves ranks out when n > 2
                movement(ours, theirs, tag=f"sub{i}-")


def mesh_2d():
    """init_device_mesh("cpu", (2, 2)): each dimension's group against gloo's."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = [[0, 1], [2, 3]]
    cols = [[0, 2], [1, 3]]
    gloo_rows = [dist.new_group(r, backend="gloo") for r in rows]
    gloo_cols = [dist.new_group(c, backend="gloo") for c in cols]
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    my_row, my_col = gloo_rows[rank // 2], gloo_cols[rank % 2]

    def layout():
        is_commlib(tp)
        is_commlib(dp)
        assert dist.get_process_group_ranks(tp) == rows[rank // 2]
        assert dist.get_process_group_ranks(dp) == cols[rank % 2]
    check.check("mesh-layout", layout)
    for name, ours, theirs in (("tp", tp, my_row), ("dp", dp, my_col)):
        def mesh_ops(g, a):
            k = dist.get_world_size(g)
            t = data((5,), torch.float32, 40)
            finish(dist.all_reduce(t, group=g, async_op=a), a)
            out = torch.zeros(3 * k)
            finish(dist.all_gather_into_tensor(out, data((3,), torch.float32, 41), group=g,
                                               async_op=a), a)
            rs = torch.zeros(2)
            finish(dist.reduce_scatter_tensor(rs, data((2 * k,), torch.float32, 42), group=g,
                                              async_op=a), a)
            return t, out, rs
        versus_gloo(f"mesh-{name}", mesh_ops, ours, theirs)
    movement(tp, my_row, tag="mesh-tp-")


def timed(name, fn):
    start = time.perf_counter()
    fn()
    if rank == 0:
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)


check.check("world-backend", lambda: is_commlib(WORLD))
timed("reductions", reductions)
timed("reduction_extras", reduction_extras)
timed("list_layouts", list_layouts)
timed("sparse", sparse)
timed("movement", movement)
timed("objects_and_barrier", objects_and_barrier)
if n == 2 and "MASTER_ADDR" not in os.environ:  # once (under mpiexec): a profiler takes ~1.5 s
    timed("profiled", profiled)
timed("point_to_point", point_to_point)
for case in (synchronous_ops_run_at_once, truly_async, wait_timeout, errors, beyond_gloo,
             premul_sum):
    timed(case.__name__, lambda: check.check(case.__name__, case))
timed("subgroups", subgroups)
if n == 4:
    timed("mesh_2d", mesh_2d)
dist.barrier()
dist.destroy_process_group()
check.finish()
