"""DDP and FSDP2 train on the "commlib" backend like on gloo, inside the same processes:
bit-identical parameters at 2 ranks, within rtol 1e-5 at 3 and 4 (the order of a sum over
more than two ranks differs between the two). Also: DDP's bucket all-reduces are in
flight, and some complete, while backward is still computing. Under mpiexec."""
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib.torch.backend as tb
from commlib.torch.hooks import RegisteredBuckets, zero_copy_hook
from harness import Checker, raises

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)
tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
COMMLIB = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
STEPS = 4
check = Checker()


class Net(nn.Module):
    """A small MLP with a branch that only some ranks use on some steps (the
    find_unused_parameters case): DDP must reduce the used-parameter map too."""

    def __init__(self, unused_branch=False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 4)])
        self.branch = nn.Linear(32, 32) if unused_branch else None

    def forward(self, x, step=0):
        x = torch.relu(self.layers[0](x))
        if self.branch is not None and (rank + step) % 2 == 0:
            x = x + self.branch(x)
        x = torch.relu(self.layers[1](x))
        return self.layers[2](x)


def batch(step):
    g = torch.Generator().manual_seed(100 * step + rank)  # every rank its own data
    return torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)


def bf16_hook(state, bucket):
    """torch's bf16_compress_hook itself. DDP refuses to register a hook *named*
    bf16_compress_hook unless CUDA+NCCL or XPU is present (whatever the backend, gloo too);
    under this name it runs on CPU."""
    return default_hooks.bf16_compress_hook(state, bucket)


def train_ddp(group, hook=None, no_sync=False, unused_branch=False, state=None, **ddp_args):
    torch.manual_seed(0)
    model = Net(unused_branch)
    ddp = DDP(model, process_group=group, **ddp_args)
    if hook is not None:
        ddp.register_comm_hook(group if state is None else state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        if no_sync:  # accumulate a micro-batch locally, then the synchronized one
            with ddp.no_sync():
                x, y = batch(step + 100)
                nn.functional.mse_loss(ddp(x, step), y).backward()
        x, y = batch(step)
        nn.functional.mse_loss(ddp(x, step), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_ddp_zero_copy(group):
    """commlib.torch.hooks.zero_copy_hook (on CPU tensors: buckets divided into twins in
    shared host memory, all-reduced in place there), against gloo's default hook."""
    if group is not COMMLIB:
        return train_ddp(group, hook=default_hooks.allreduce_hook)
    raises(TypeError, "group of the commlib backend", lambda: RegisteredBuckets(GLOO))
    state = RegisteredBuckets(group)
    params = train_ddp(group, hook=zero_copy_hook, state=state, bucket_cap_mb=0.001)
    assert state.registered == {} and state.possible  # host memory: nothing to register
    assert bool(state.twins) == ("one_copy" in group.comm.algorithms("all_reduce"))
    assert state.twins or group.comm.transport != "shm", "no shared twins on shared memory"
    return params


def train_fsdp(group, reshard_after_forward):
    torch.manual_seed(0)
    model = Net()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def same_params(got, want, start, hook_dtype=None):
    """Bit-identical at 2 ranks (a two-term sum is the same in any order); rtol 1e-5 at 3+.
    A 16-bit compression hook sums 16-bit values, which commlib adds in fp32 and rounds
    once while gloo rounds after every addition: at 3+ ranks those differ by 16-bit
    rounding, so they must agree to that format's epsilon of the training update."""
    assert len(got) == len(want) == len(start)
    for i, (g, w, w0) in enumerate(zip(got, want, start)):
        if n == 2:
            assert torch.equal(g, w), f"param {i}: max diff {(g - w).abs().max().item():.3g}"
        elif hook_dtype is None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"param {i}: {m}")
        else:
            diff = (g - w).abs().max().item()
            bound = torch.finfo(hook_dtype).eps * (w - w0).abs().max().item()
            assert diff <= bound, (f"param {i}: diff {diff:.3g} > {hook_dtype} eps * update "
                                   f"{bound:.3g}")


def versus_gloo(name, train, hook_dtype=None, **kwargs):
    def run():
        torch.manual_seed(0)
        start = [p.detach().clone() for p in Net(kwargs.get("unused_branch", False)).parameters()]
        ours = train(COMMLIB, **kwargs)
        theirs = train(GLOO, **kwargs)
        same_params(ours, theirs, start, hook_dtype)
        assert not all(torch.equal(a, b) for a, b in zip(ours, start)), "training did nothing"
        mine = torch.cat([p.flatten() for p in ours])
        everyone = [torch.zeros_like(mine) for _ in range(n)]
        dist.all_gather(everyone, mine, group=GLOO)
        assert all(torch.equal(e, mine) for e in everyone), "ranks ended with different params"
    check.check(name, run)


def bucket_all_reduces_overlap_backward():
    """Record each all_reduce DDP issues on the commlib group (when it was issued and when it
    completed) against the moment the last gradient of backward was computed: with several
    buckets, all but the last must be issued before that moment, and (at 2 ranks) on some
    rank at least one must have completed before it: it ran while autograd was still
    computing. With 3-4 ranks on fewer cores, a rank may finish backward before a
    descheduled peer has even issued the first bucket, so completion before the end says
    nothing there."""
    torch.manual_seed(0)
    # Backward runs from the end: the small tail layers' buckets go out first, then the wide
    # first layer keeps autograd busy while they are reduced.
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 64), nn.ReLU(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 8))
    ddp = DDP(model, process_group=COMMLIB, bucket_cap_mb=0.01)
    events = []

    def record(group, what, work):
        if group is COMMLIB and what == "allreduce":
            event = {"issued": time.perf_counter(), "done": None,
                     "in_flight": not work.is_completed()}  # async: still running at return
            events.append(event)
            work.get_future().add_done_callback(
                lambda _: event.__setitem__("done", time.perf_counter()))

    last_grad = []
    model[0].weight.register_hook(lambda g: last_grad.append(time.perf_counter()))
    x = torch.randn(512, 2048, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the second iteration runs on DDP's rebuilt buckets
        events.clear()
        last_grad.clear()
        ddp.zero_grad()
        tb.set_trace_hook(record)
        try:
            ddp(x).sum().backward()
        finally:
            tb.set_trace_hook(None)
    end = last_grad[-1]
    issued_before = sum(e["issued"] < end for e in events)
    in_flight = sum(e["issued"] < end and e["in_flight"] for e in events)
    done_before = sum(e["done"] is not None and e["done"] < end for e in events)
    # (the most on any rank: a rank whose peer lags, descheduled, can finish backward before
    # the peer issues its first bucket; the lagging one then sees its buckets complete)
    most_done_before = torch.tensor([done_before])
    dist.all_reduce(most_done_before, dist.ReduceOp.MAX, group=GLOO)
    if rank == 0:
        print(f"overlap: {len(events)} bucket all_reduces, {issued_before} issued "
              f"({in_flight} still in flight when the call returned) and {done_before} "
              f"completed before backward's last gradient", flush=True)
    assert len(events) >= 4, f"expected several buckets, got {len(events)}"
    assert issued_before >= len(events) - 1, f"only {issued_before} issued during backward"
    assert in_flight >= 1, "every all_reduce had completed before DDP's call returned"
    if n == 2:
        assert most_done_before.item() >= 1, \
            "no bucket all_reduce completed while backward was running, on any rank"


versus_gloo("ddp", train_ddp)
versus_gloo("ddp-find_unused_parameters", train_ddp, unused_branch=True,
            find_unused_parameters=True)
versus_gloo("ddp-gradient_as_bucket_view", train_ddp, gradient_as_bucket_view=True)
versus_gloo("ddp-no_sync", train_ddp, no_sync=True)
versus_gloo("ddp-static_graph", train_ddp, static_graph=True)
versus_gloo("ddp-small_buckets", train_ddp, bucket_cap_mb=0.001)
versus_gloo("ddp-allreduce_hook", train_ddp, hook=default_hooks.allreduce_hook)
versus_gloo("ddp-fp16_compress_hook", train_ddp, hook=default_hooks.fp16_compress_hook,
            hook_dtype=torch.float16)
versus_gloo("ddp-bf16_compress_hook", train_ddp, hook=bf16_hook, hook_dtype=torch.bfloat16)
versus_gloo("ddp-zero_copy_hook", train_ddp_zero_copy)
versus_gloo("fsdp2-reshard", train_fsdp, reshard_after_forward=True)
versus_gloo("fsdp2-no_reshard", train_fsdp, reshard_after_forward=False)
check.check("ddp_overlap", bucket_all_reduces_overlap_backward)
dist.barrier()
dist.destroy_process_group()
check.finish()
