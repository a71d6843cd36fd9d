"""The "commlib" torch backend on CUDA tensors (the ranks share device 0), under mpiexec:
collectives and send/recv against exact values, stream order, and DDP and FSDP2 training
on the GPU against the same training on CPU tensors (which torch_train.py checks against
gloo), compressed (commlib.torch.compression) too."""
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib.torch.backend as tb
from commlib.torch.compression import (CompressedAllGather, CompressedBuckets,
                                       CompressedReduceScatter, compressed_hook)
from commlib.torch.hooks import RegisteredBuckets, zero_copy_hook
from harness import Checker

warnings.filterwarnings("ignore", category=FutureWarning)
tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
GPU = torch.device("cuda", 0)
check = Checker()


def collectives():
    t = torch.full((1000,), rank + 1.0, device=GPU)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((1000,), n * (n + 1) / 2))
    w = dist.all_reduce(u := torch.ones(7, device=GPU, dtype=torch.bfloat16), async_op=True)
    w.wait()  # the current stream waits; the next kernel sees the sum
    assert torch.equal((u * 2).float().cpu(), torch.full((7,), 2.0 * n))
    out = torch.zeros(3 * n, device=GPU)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=GPU))
    assert torch.equal(out.cpu(), torch.arange(n).repeat_interleave(3).float())
    rs = torch.zeros(2, device=GPU)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n, device=GPU))
    assert torch.equal(rs.cpu(), n * torch.arange(2.0 * rank, 2.0 * rank + 2))
    b = torch.full((5,), float(rank), device=GPU)
    dist.broadcast(b, src=n - 1)
    assert torch.equal(b.cpu(), torch.full((5,), n - 1.0))
    a2a = torch.zeros(n, device=GPU)
    dist.all_to_all_single(a2a, torch.arange(n, device=GPU) + 10.0 * rank)
    assert torch.equal(a2a.cpu(), torch.arange(n) * 10.0 + rank)
    outs = [torch.zeros(2, device=GPU) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), rank + 0.5, device=GPU))
    assert all(torch.equal(o.cpu(), torch.full((2,), r + 0.5)) for r, o in enumerate(outs))
    nc = torch.zeros(4, 2, device=GPU).t()  # non-contiguous: staged and copied back
    nc += rank
    dist.all_reduce(nc)
    assert torch.equal(nc.cpu(), torch.full((2, 4), n * (n - 1) / 2))


def send_and_recv():
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(6, device=GPU)
    ops = [dist.P2POp(dist.isend, torch.full((6,), rank * 2.0, device=GPU), right),
           dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got.cpu(), torch.full((6,), left * 2.0))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 4)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def train(device, wrap, steps=4):
    torch.manual_seed(0)
    model = Net().to(device)
    model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for p in model.parameters()]


def close(gpu, cpu):
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"param {i}: {m}")


def ddp_on_cuda_trains_as_on_cpu():
    close(train(GPU, lambda m: DDP(m, device_ids=[0])), train("cpu", DDP))


def ddp_with_registered_buckets_on_cuda_trains_as_on_cpu():
    """commlib.torch.hooks: every bucket registered, its all-reduce zero-copy (2+ ranks)."""
    state = RegisteredBuckets()

    def wrap(model):
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.001)
        ddp.register_comm_hook(state, zero_copy_hook)
        return ddp
    close(train(GPU, wrap), train("cpu", DDP))
    if n > 1:
        assert state.possible and len(state.registered) > 1, state.registered
        calls = dist.group.WORLD.comm.flight_record()
        assert any(c["algorithm"] == "zerocopy" for c in calls), calls[-3:]


def roughly(gpu, cpu):
    """Compressed training on the GPU as on the CPU: the same packets for the same values,
    but the devices' arithmetic makes the gradients differ in their last bits, and a
    format's rounding may then differ by a step."""
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        torch.testing.assert_close(g, c, rtol=1e-2, atol=2e-3, msg=lambda m: f"param {i}: {m}")


def compressed_ddp_on_cuda_trains_as_on_cpu():
    """commlib.torch.compression's hook on CUDA buckets: encoded on the device in the
    CPU's packets, so the GPU's training follows the CPU's within the format's rounding
    of gradients that differ by the devices' arithmetic; the replicas stay equal."""
    def hooked(device_ids, states):
        def wrap(model):
            ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=0.001)
            states.append(CompressedBuckets(wire="int8"))
            ddp.register_comm_hook(states[-1], compressed_hook)
            return ddp
        return wrap
    gpu_states, cpu_states = [], []
    gpu, cpu = train(GPU, hooked([0], gpu_states)), train("cpu", hooked(None, cpu_states))
    roughly(gpu, cpu)
    flat = torch.cat([p.reshape(-1) for p in gpu]).to(GPU)
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone), "the GPU replicas differ"
    if n > 1:
        assert gpu_states[0].bytes_sent > 0 and len(gpu_states[0].feedback) > 1


def fsdp2_on_cuda_trains_as_on_cpu():
    def shard(device):
        def wrap(model):
            mesh = DeviceMesh.from_group(dist.group.WORLD, device)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        return wrap
    close(train(GPU, shard("cuda")), train("cpu", shard("cpu")))


def compressed_fsdp2_on_cuda_trains_as_on_cpu():
    """FSDP2 with each layer's reduce-scatter in int8 and its all-gathers in bf16
    (commlib.torch.compression), on CUDA tensors as on CPU ones."""
    def shard(device):
        def wrap(model):
            mesh = DeviceMesh.from_group(dist.group.WORLD, device)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
                layer.set_custom_reduce_scatter(CompressedReduceScatter("int8"))
                layer.set_custom_all_gather(CompressedAllGather("bf16"))
            return fully_shard(model, mesh=mesh)
        return wrap
    roughly(train(GPU, shard("cuda")), train("cpu", shard("cpu")))


check.run_cases(globals())
