"""PyTorch's own parallelisms on the commlib backend, each against gloo in the same run:
DTensor redistributions (1-D mesh; 2-D at 4 ranks), parallelize_module (tensor parallel),
FSDP2 x TP (4 ranks), torch.distributed.pipelining (GPipe, 1F1B) and functional
collectives, eager and under torch.compile. Results must be bitwise gloo's: the same
reductions in the same order on so few ranks, and data whose sums are exact.

Usage: torchrun --nproc-per-node N tests/mpi/torch_ecosystem.py   (N = 2..4; or mpiexec)
"""
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import commlib.torch.backend as tb
from harness import Checker

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)
tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
check = Checker()


def meshes(shape, names):
    """One device mesh of ``shape`` per backend: commlib's (the default) and gloo's. Their
    dimensions are named apart: DTensor's caches take two meshes of the same ranks and
    names for one (DeviceMesh's equality ignores the backend), and would run gloo's ops on
    commlib's groups."""
    gloo_names = tuple(f"gloo_{name}" for name in names)
    return {"commlib": init_device_mesh("cpu", shape, mesh_dim_names=names),
            "gloo": init_device_mesh("cpu", shape, mesh_dim_names=gloo_names,
                                     backend_override=dict.fromkeys(gloo_names, "gloo"))}


MESH_1D = meshes((n,), ("tp",))
MESH_2D = meshes((2, 2), ("dp", "tp")) if n == 4 else None


def ints(*shape, salt=0, who=0):
    """Small integers as float32 (sums exact), the same on every rank unless ``who``."""
    g = torch.Generator().manual_seed(100 * salt + who)
    return torch.randint(-4, 5, shape, generator=g).float()


def per_backend(meshes: dict, run) -> dict:
    """{backend: run(its mesh)}; commlib's groups carry every op of commlib's run and none
    of gloo's (so that the comparison is between the two)."""
    out = {}
    for name, mesh in meshes.items():
        ops = []
        tb.set_trace_hook(lambda group, what, work: ops.append(what))
        try:
            out[name] = run(mesh)
        finally:
            tb.set_trace_hook(None)
        assert bool(ops) == (name == "commlib"), f"{name}'s run: {len(ops)} ops on commlib"
    return out


def bitwise(results: dict, what: str):
    """Every backend's results (lists of tensors) equal commlib's bit for bit."""
    want = results["commlib"]
    for name, got in results.items():
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.shape == b.shape and torch.equal(a, b), \
                f"{what}[{i}]: {name} differs from commlib: {a} vs {b}"


def dtensor_redistributions():
    """Shard <-> Replicate <-> Partial on uneven shapes (7 x 5 over 2-4 ranks)."""
    x = ints(7, 5, salt=1)

    def one_d(mesh):
        d = distribute_tensor(x, mesh, [Shard(0)])
        partial = DTensor.from_local(ints(7, 5, salt=2, who=rank), mesh, [Partial()])
        return [d.redistribute(mesh, [Replicate()]).to_local(),
                d.redistribute(mesh, [Shard(1)]).to_local(),
                d.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Shard(0)]).to_local(),
                partial.redistribute(mesh, [Replicate()]).to_local(),
                partial.redistribute(mesh, [Shard(0)]).to_local(),
                partial.redistribute(mesh, [Shard(1)]).full_tensor()]
    out = per_backend(MESH_1D, one_d)
    bitwise(out, "1-D")
    assert torch.equal(out["commlib"][0], x)
    if MESH_2D is None:
        return

    def two_d(mesh):
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        partial = DTensor.from_local(ints(7, 5, salt=3, who=rank), mesh, [Partial(), Shard(0)])
        return [d.redistribute(mesh, [Replicate(), Replicate()]).to_local(),
                d.redistribute(mesh, [Shard(1), Replicate()]).to_local(),
                partial.redistribute(mesh, [Replicate(), Shard(0)]).to_local(),
                partial.full_tensor()]
    bitwise(per_backend(MESH_2D, two_d), "2-D")


def mlp(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))
    with torch.no_grad():  # small integers / 8: every product and sum exact in float32
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape).float() / 8)
        model[2].bias.mul_(3)  # (row-parallel: each of 3 ranks adds a third of it)
    return model


TP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def parallelize_module_tp():
    """A tensor-parallel MLP: output and gradients as gloo's, the output as one process's."""
    x = ints(4, 8, salt=4)

    def run(mesh):
        model = parallelize_module(mlp(), mesh, TP_PLAN)
        y = model(x)
        y.sum().backward()
        return [y, *(p.grad.full_tensor() for p in model.parameters())]
    out = per_backend(MESH_1D, run)
    bitwise(out, "parallelize_module")
    alone = mlp()
    y = alone(x)
    y.sum().backward()
    assert torch.equal(out["commlib"][0], y), (out["commlib"][0] - y)


def fsdp2_x_tp():
    """FSDP2 over dp, TP over tp on a 2 x 2 mesh: two SGD steps, losses and weights."""
    if MESH_2D is None:
        return

    def run(mesh):
        dp, tp = (mesh[name] for name in mesh.mesh_dim_names)
        model = fully_shard(parallelize_module(mlp(), tp, TP_PLAN), mesh=dp)
        opt = torch.optim.SGD(model.parameters(), lr=0.125)
        losses = []
        for step in range(2):
            loss = model(ints(2, 8, salt=5 + step, who=dp.get_local_rank())).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return [*losses, *(p.full_tensor() for p in model.parameters())]
    bitwise(per_backend(MESH_2D, run), "FSDP2 x TP")


def pipelining():
    """One Linear stage per rank, 4 microbatches, GPipe and 1F1B: the last stage's losses
    and every stage's gradients as gloo's."""
    x, target = ints(8, 6, salt=6), ints(8, 6, salt=7)

    def run(mesh):
        group = mesh.get_group()
        got = []
        for schedule in (ScheduleGPipe, Schedule1F1B):
            torch.manual_seed(rank)
            stage_module = nn.Linear(6, 6)
            stage = PipelineStage(stage_module, rank, n, torch.device("cpu"), group=group)
            run = schedule(stage, n_microbatches=4,
                           loss_fn=lambda y, t: ((y - t) ** 2).sum())
            losses = []
            if rank == 0:
                run.step(x)
            elif rank == n - 1:
                run.step(target=target, losses=losses)
            else:
                run.step()
            got += [torch.stack(losses) if losses else torch.zeros(0),
                    stage_module.weight.grad.clone()]
        return got
    bitwise(per_backend(MESH_1D, run), "pipelining")


def functional_collectives():
    """funcol's all_reduce, all_gather_tensor, reduce_scatter_tensor, all_to_all_single,
    eager and compiled (aot_eager: dynamo's tracing of them, no C++ compiler needed)."""
    x = ints(n * 3, salt=8, who=rank)

    def calls(group):
        return [funcol.all_reduce(x, "sum", group),
                funcol.all_gather_tensor(x, 0, group),
                funcol.reduce_scatter_tensor(x, "sum", 0, group),
                funcol.all_to_all_single(x, None, None, group)]
    compiled = torch.compile(lambda g: [t * 1 for t in calls(g)], backend="aot_eager")
    bitwise(per_backend(MESH_1D, lambda mesh: [funcol.wait_tensor(t) for t in
                                               calls(mesh.get_group())] +
                        compiled(mesh.get_group())), "functional collectives")


for case in (dtensor_redistributions, parallelize_module_tp, fsdp2_x_tp, pipelining,
             functional_collectives):
    check.check(case.__name__, case)
check.finish()
