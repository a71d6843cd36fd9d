"""commlib_strategies.moe under mpiexec (2 or 4 ranks): the uneven all-to-all mapping, the
expert-parallel MoE layer against the single-process layer on the global batch (outputs,
routing, aux loss, gradients; at 4 ranks also EP 2 x TP 2, expert tensor parallelism, with
and without Megatron SP), and the MoE GPT trained at EP = n, at DP = n (EP 1) and, at 4
ranks, at EP 2 (each half of the ranks on its own), EP x DP = 2 x 2 (also with ZeRO 1, 2
and 3: dense parameters sharded over all 4 ranks, experts over dp), EP x TP = 2 x 2 (also
with Megatron SP and ZeRO 3), EP x CP = 2 x 2 (ring; Ulysses with ZeRO 2: routing groups
spanning the cp ranks) and TP x CP = 2 x 2 (Ulysses; ep 1), against the single-process MoE
GPT on the same global batch with the same routing groups: the same assignments dropped at
every step, and losses and gathered parameters after 5 steps within 1e-4 relative (fp32),
top-1 and top-2. At 4 ranks also pipelines of MoE blocks: PP 2 x EP 2 (1f1b, zb-h1's split
backward, ZeRO 3 reducing during the schedule), PP 2 x DP 2 (ZeRO 1), PP 2 x TP 2 (1f1b;
gpipe with Megatron SP) and PP 2 x CP 2 (ring, zb-h1), each microbatch a routing group,
every stage's aux losses in the loss; zb-h1 refused for experts split over tp."""
import torch

import commlib
from harness import Checker, close, raises, same_as, use_device
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.mappings import all_to_all_uneven
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.expert_parallel import (data_shard, gathered_state, reduce_gradients,
                                                zero_arguments)
from commlib_strategies.layout import Layout, check as check_layout
from commlib_strategies.moe import MoE, ExpertParallelMoE, moe_gpt
from commlib_strategies.parallelize import parallelize
from commlib_strategies.pipeline import Pipeline, PipelineStage
from commlib_strategies.plans import PLANS
from commlib_strategies.sequence_parallel import sequence_shard
from commlib_strategies.zero import ZeRO

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()  # COMMLIB_TEST_DEVICE=cuda: on GPU 0

CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2)
DATA = AdditionDataset(seed=0)
BATCH, GROUP_ROWS, STEPS, EXPERTS = 8, 2, 5, 4  # every rank's shard: whole routing groups
PLAN = PLANS["gpt-moe"]


def data(salt, shape):
    g = torch.Generator().manual_seed(salt)  # on the CPU: the same data on every device
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(DEVICE)


# ------------------------------------------------------------------------------ the mapping

def all_to_all_uneven_mapping():
    def rows(src, dst):  # some counts are zero
        return (src + 2 * dst) % 3

    def block(src, dst):
        return data(100 * src + dst, (rows(src, dst), 2, 3))

    send = [rows(rank, j) for j in range(n)]
    recv = [rows(j, rank) for j in range(n)]
    x = torch.cat([block(rank, j) for j in range(n)]).requires_grad_(True)
    y = all_to_all_uneven(x, world, send, recv)
    close(y.detach(), torch.cat([block(j, rank) for j in range(n)]))
    # loss: sum over ranks of <y_r, w_r>; x's gradient is w of the rows' destinations
    (y * torch.cat([data(7 + rank, (rows(j, rank), 2, 3)) for j in range(n)])).sum().backward()
    close(x.grad, torch.cat([data(7 + j, (rows(rank, j), 2, 3)) for j in range(n)]))
    raises(ValueError, f"send_rows sum to {sum(send)}, but the tensor has {sum(send) + 1} rows",
           lambda: all_to_all_uneven(torch.zeros(sum(send) + 1, 2), world, send, recv))


# ------------------------------------------------------------------------------ the layer

def ep_layer_matches_one_process():
    """ep = n, fp64: each rank's output rows, the routing (dropped count), the aux loss and
    every gradient equal the single-process layer's on the global batch."""
    for topk in (1, 2):
        torch.manual_seed(3)
        # two experts per rank: rows arrive by source and are regrouped by expert
        ref = MoE(8, 12, 2 * n, topk, capacity_factor=1.0, group_rows=GROUP_ROWS).double()
        layer = ExpertParallelMoE(ref, world)
        assert list(layer.experts) == [str(2 * rank), str(2 * rank + 1)]
        x, w = data(1, (GROUP_ROWS * n, 5, 8)), data(2, (GROUP_ROWS * n, 5, 8))
        xr, xl = x.clone().requires_grad_(True), shard(x, rank, n).clone().requires_grad_(True)
        want = ref(xr)
        got = layer(xl)
        close(got.detach(), shard(want.detach(), rank, n))
        assert ref.dropped > 0  # capacity does refuse some assignments here
        dropped = torch.tensor([layer.dropped])
        world.all_reduce(dropped)
        assert dropped.item() == ref.dropped
        # losses: the reference's is the sum over ranks' (the aux loss a mean over groups)
        ((want * w).sum() + ref.aux_loss).backward()
        ((got * shard(w, rank, n)).sum() + layer.aux_loss / n).backward()
        aux = layer.aux_loss.detach().clone()
        world.all_reduce(aux, op="avg")
        close(aux, ref.aux_loss.detach())
        close(xl.grad, shard(xr.grad, rank, n))
        for p in layer.parameters():
            if not getattr(p, "expert_parallel", False):  # the router: partial on each rank
                world.all_reduce(p.grad)
        same_as(gathered_state(layer, world, grads=True),
                {k: p.grad for k, p in ref.named_parameters()}, rtol=1e-10, atol=1e-12)


def ep_x_tp_layer_matches_one_process():
    """At 4 ranks, tp 2 x ep 2, fp64: expert tensor parallelism (and with Megatron SP,
    sequence shards in and out) gives the single-process layer's outputs, routing, aux loss
    and gradients."""
    if n != 4:
        return
    mesh = Mesh(world, ep=2, tp=2)
    ep, tp = mesh.group("ep"), mesh.group("tp")
    for topk, sp in ((1, True), (2, False)):
        torch.manual_seed(4)
        ref = MoE(8, 12, 4, topk, capacity_factor=1.0, group_rows=GROUP_ROWS).double()
        layer = ExpertParallelMoE(ref, ep, tp=tp, sequence_parallel=sp)
        x, w = data(3, (GROUP_ROWS * 2, 6, 8)), data(4, (GROUP_ROWS * 2, 6, 8))

        def mine(t):  # this rank's rows (its ep rank's), and under SP its tp shard of time
            t = shard(t, ep.rank, 2)
            return t.chunk(2, 1)[tp.rank] if sp else t
        xr, xl = x.clone().requires_grad_(True), mine(x).clone().requires_grad_(True)
        want, got = ref(xr), layer(xl)
        close(got.detach(), mine(want.detach()))
        dropped = torch.tensor([layer.dropped])
        ep.all_reduce(dropped)
        assert ref.dropped > 0 and dropped.item() == ref.dropped
        # the reference's loss is the ep ranks' sum; under SP each tp rank adds its shard's
        # outputs, and every tp rank the (replicated) aux loss
        ((want * w).sum() + ref.aux_loss).backward()
        ((got * mine(w)).sum() + layer.aux_loss / 2).backward()
        close(xl.grad, mine(xr.grad))
        ep.all_reduce(layer.router.weight.grad)  # each ep rank's tokens' part
        same_as(gathered_state(layer, ep, grads=True, tp=tp),
                {k: p.grad for k, p in ref.named_parameters()}, rtol=1e-10, atol=1e-12)
    mesh.free()


# ------------------------------------------------------------------------------ training

class _SGD:
    """SGD with momentum 0.9, as torch.optim.SGD computes it (whose first use imports
    torch._dynamo: seconds per rank on a loaded machine)."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.velocity = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, v in zip(self.params, self.velocity):
            v.mul_(self.momentum).add_(p.grad)
            p.sub_(self.lr * v)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def batches():
    return [DATA.batch(step, BATCH, CONFIG.seq_len) for step in range(STEPS)]


def moe_model(topk):
    return moe_gpt(GPT(CONFIG, seed=1), experts=EXPERTS, topk=topk, capacity_factor=1.0,
                   group_rows=GROUP_ROWS, aux_weight=0.1, seed=2)


def _moe_layers(model):
    """The model's MoE layers (ExpertParallelMoE ones too), block by block."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def _dropped(model):
    return [layer.dropped for layer in _moe_layers(model)]


def parallel_moe_model(topk, mesh, sp=None):
    """The MoE GPT made parallel on ``mesh`` by its plan; its MoE layers expert-parallel
    (over ep, split over tp, on cp's or Megatron SP's shards) wherever the mesh has tp, cp
    or ep."""
    model = parallelize(moe_model(topk), mesh, PLAN, sp)
    groups = {d: mesh.group(d) if mesh.size(d) > 1 else None for d in ("tp", "cp", "ep")}
    layers = _moe_layers(model)
    assert len(layers) == CONFIG.n_layers
    for layer in layers:
        if any(groups.values()):
            assert isinstance(layer, ExpertParallelMoE), type(layer)
            assert layer.group.size == mesh.size("ep") and layer.tp is groups["tp"] \
                and layer.cp is groups["cp"], layer
            assert layer.sequence_parallel == (sp == "megatron" and groups["tp"] is not None)
        else:
            assert type(layer) is MoE, type(layer)
    return model


def _reference(topk):
    """Losses, assignments dropped per step and layer, and parameters after STEPS steps."""
    model = moe_model(topk)
    opt = _SGD(model.parameters())
    losses, dropped = [], []
    for x, y in batches():
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        dropped.append(_dropped(model))
    assert sum(map(sum, dropped)) > 0, "nothing was dropped: the test would not cover capacity"
    return losses, dropped, {k: v.detach() for k, v in model.named_parameters()}


REFERENCE = {topk: _reference(topk) for topk in (1, 2)}


def _hold_gathered(model, zero):
    """After ZeRO 3's last step: every parameter of ``model`` holds its whole value again
    (for the comparisons; ZeRO is done with the model)."""
    whole = zero.full_parameters()
    for name, p in model.named_parameters():
        p.data = whole[name]


def _train_parallel(mesh, zero=0, topks=(1, 2), sp=None):
    """Train on ``mesh`` (dp x ep, x tp or x cp, over mesh.world), with ZeRO ``zero`` or
    ``reduce_gradients``; compare with the reference."""
    ranks = mesh.joint_group("dp", "ep")  # the ranks that see different data
    tp = mesh.group("tp") if mesh.size("tp") > 1 else None
    for topk in topks:
        model = parallel_moe_model(topk, mesh, sp)
        held = {False: 0, True: 0}  # this rank's (tp slices of) dense and expert parameters
        for p in model.parameters():
            held[getattr(p, "expert_parallel", False)] += p.numel()
        opt = ZeRO(model, stage=zero, optimizer=_SGD, **zero_arguments(model, mesh)) if zero \
            else _SGD(model.parameters())
        if zero:  # dense parameters sharded over the dp x ep ranks, experts over dp
            most = held[False] // ranks.size + held[True] // mesh.size("dp") + len(opt.units)
            assert opt.master.numel() <= most, (opt.master.numel(), most)
        losses, dropped = [], []
        for x, y in batches():
            x, y = data_shard(x, mesh), data_shard(y, mesh)
            if mesh.size("cp") > 1:
                x, y = sequence_shard(x, mesh.group("cp")), sequence_shard(y, mesh.group("cp"))
            loss = model.loss(x, y)
            loss.backward()
            if not zero:
                reduce_gradients(model, mesh)
            opt.step()
            opt.zero_grad()
            mean, drops = loss.detach().clone(), torch.tensor(_dropped(model))
            ranks.all_reduce(mean, op="avg")
            ranks.all_reduce(drops)
            losses.append(mean.item())
            dropped.append(drops.tolist())
        want_losses, want_dropped, want_params = REFERENCE[topk]
        assert dropped == want_dropped, (dropped, want_dropped)  # the same routing
        close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
        if zero == 3:
            _hold_gathered(model, opt)
        same_as(gathered_state(model, mesh.group("ep"), tp=tp), want_params)
        # every replica identical: dense parameters on the dp x ep ranks, experts over dp
        # (tp ranks hold their own slices of the split ones)
        for name, p in model.named_parameters():
            group = mesh.group("dp") if getattr(p, "expert_parallel", False) else ranks
            everyone = torch.empty((group.size,) + p.shape)
            group.all_gather(everyone, p.detach().contiguous())
            assert all(torch.equal(everyone[0], e) for e in everyone), f"{name} differs"
    mesh.free()


def ep_trains_like_one_process():
    _train_parallel(Mesh(world, ep=n))


def ep2_trains_like_one_process_on_each_half():
    """At 4 ranks: two independent EP-2 jobs, ranks {0, 1} and {2, 3}."""
    if n == 4:
        half = world.split(rank // 2)
        _train_parallel(Mesh(half, ep=2))
        half.free()


def ep_x_dp_trains_like_one_process():
    if n == 4:
        _train_parallel(Mesh(world, dp=2, ep=2))


def ep_x_dp_with_zero_trains_like_one_process():
    if n == 4:
        _train_parallel(Mesh(world, dp=2, ep=2), zero=1, topks=(2,))
        _train_parallel(Mesh(world, dp=2, ep=2), zero=2, topks=(1,))
        _train_parallel(Mesh(world, dp=2, ep=2), zero=3, topks=(2,))


def tp_x_cp_with_experts_trains_like_one_process():
    """At 4 ranks: tp 2 x cp 2 (Ulysses over each tp rank's heads), the experts split over
    tp and routing groups spanning the cp ranks (ep 1: every other path runs)."""
    if n == 4:
        _train_parallel(Mesh(world, tp=2, cp=2), topks=(2,), sp="ulysses")


def _whole_pipeline_state(stage, mesh) -> dict:
    """Every parameter of the reference, by name, from a pipeline stage of an expert-parallel
    GPT: experts gathered over ep (slices over tp), then the stages' parts summed over pp
    (each name is held by one stage; the others add zeros)."""
    tp = mesh.group("tp") if mesh.size("tp") > 1 else None
    mine = {}
    for piece in stage.pieces:
        mine.update(gathered_state(piece.model, mesh.group("ep"), tp=tp))
    shapes = {k: v.shape for k, v in REFERENCE[1][2].items()}
    flat = torch.cat([mine[k].reshape(-1) if k in mine else torch.zeros(s.numel())
                      for k, s in shapes.items()])
    mesh.group("pp").all_reduce(flat)
    return dict(zip(shapes, (t.view(s) for t, s in
                             zip(flat.split([s.numel() for s in shapes.values()]),
                                 shapes.values()))))


def _train_pipeline(mesh, topk, schedule, zero=0, sp=None):
    """Pipeline stages of the expert-parallel GPT on ``mesh`` (pp x dp x ep, x tp or x cp
    with ``sp``), each rank's data shard in microbatches of a routing group each; compare
    with the reference."""
    stage = PipelineStage(parallel_moe_model(topk, mesh, sp), PLAN, mesh.group("pp"))
    data_ranks = mesh.joint_group("dp", "ep")
    if zero:
        opt = ZeRO(stage, stage=zero, optimizer=_SGD, reduce_in_backward=False,
                   **zero_arguments(stage, mesh))
        assert opt.group is data_ranks and data_ranks.size == 2
    else:
        opt = _SGD(stage.parameters())
    microbatches = BATCH // (GROUP_ROWS * data_ranks.size)
    pipe = Pipeline(stage, schedule, microbatches, measure=False,
                    **({"gradients": opt} if zero >= 2 else {}))
    def mine(t):  # this rank's rows, and under cp its shard of time
        t = data_shard(t, mesh)
        return sequence_shard(t, mesh.group("cp")) if mesh.size("cp") > 1 else t

    losses = []
    for x, y in batches():
        loss = torch.tensor([pipe.step(mine(x), mine(y))])
        if not zero:
            reduce_gradients(stage, mesh)
        opt.step()
        opt.zero_grad()
        data_ranks.all_reduce(loss, op="avg")
        losses.append(loss.item())
    if zero == 3:
        _hold_gathered(stage, opt)
    want_losses, _, want_params = REFERENCE[topk]
    close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    same_as(_whole_pipeline_state(stage, mesh), want_params)
    mesh.free()


def ep_x_tp_trains_like_one_process():
    """At 4 ranks: expert tensor parallelism, tp 2 x ep 2, without and with Megatron SP."""
    if n == 4:
        _train_parallel(Mesh(world, ep=2, tp=2), topks=(2,))
        _train_parallel(Mesh(world, ep=2, tp=2), topks=(1,), sp="megatron", zero=3)


def ep_x_cp_trains_like_one_process():
    """At 4 ranks: cp 2 x ep 2, routing groups spanning the cp ranks (ring, Ulysses)."""
    if n == 4:
        _train_parallel(Mesh(world, ep=2, cp=2), topks=(2,), sp="ring")
        _train_parallel(Mesh(world, ep=2, cp=2), topks=(1,), sp="ulysses", zero=2)


def pp_x_ep_trains_like_one_process():
    if n == 4:
        _train_pipeline(Mesh(world, pp=2, ep=2), topk=2, schedule="1f1b")
        _train_pipeline(Mesh(world, pp=2, ep=2), topk=1, schedule="zb-h1")
        # ZeRO 3 reduces during the schedule as 2 does, and gathers each piece's units
        _train_pipeline(Mesh(world, pp=2, ep=2), topk=2, schedule="gpipe", zero=3)


def pp_x_tp_with_experts_trains_like_one_process():
    """At 4 ranks: pipeline stages of expert tensor parallelism (ep 1: the all-to-all is
    trivial, every other path runs), plain and with Megatron SP (the stages pass whole
    sequences, sharded again before each piece's first block)."""
    if n == 4:
        _train_pipeline(Mesh(world, pp=2, tp=2), topk=2, schedule="1f1b")
        _train_pipeline(Mesh(world, pp=2, tp=2), topk=1, schedule="gpipe", sp="megatron")


def pp_x_cp_with_experts_trains_like_one_process():
    """At 4 ranks: pipeline stages of the MoE GPT made context-parallel (ring attention), with
    zb-h1's split backward: each stage passes its cp rank's sequence shard."""
    if n == 4:
        _train_pipeline(Mesh(world, pp=2, cp=2), topk=2, schedule="zb-h1", sp="ring")


def pp_x_dp_with_experts_and_zero_trains_like_one_process():
    if n == 4:
        _train_pipeline(Mesh(world, pp=2, dp=2), topk=1, schedule="1f1b", zero=1)


def dp_alone_trains_like_one_process():
    """ep = 1: every rank holds every expert; experts and dense parameters averaged over dp."""
    _train_parallel(Mesh(world, dp=n))


def errors():
    raises(ValueError, f"experts=3 is not divisible by ep={n}",
           lambda: ExpertParallelMoE(MoE(8, 8, 3, 1), world))
    mesh = Mesh(world, ep=n)  # through parallelize
    raises(ValueError, f"expert parallel: experts=3 is not divisible by ep={n}",
           lambda: parallelize(moe_gpt(GPT(CONFIG, seed=1), experts=3, topk=1), mesh, PLAN))
    mesh.free()
    # sp that does not fit the layout: refused by the layout's check (parallelize takes
    # sp=None on cp as ring attention, and ignores "megatron" without tp)
    sizes = dict(world_size=n, batch=BATCH, seq_len=CONFIG.seq_len, heads=CONFIG.n_heads,
                 layers=CONFIG.n_layers)
    raises(ValueError, f"--cp {n} needs the attention that works on sequence shards",
           lambda: check_layout(Layout(dp=1, cp=n, experts=EXPERTS), **sizes))
    raises(ValueError, "--sp megatron shards tensor parallelism's activations along the "
           "sequence: add --tp 2 or more",
           lambda: check_layout(Layout(dp=1, ep=n, sp="megatron", experts=EXPERTS), **sizes))
    if n == 4:
        mesh = Mesh(world, pp=2, tp=2)
        stage = PipelineStage(parallelize(moe_model(1), mesh, PLAN), PLAN, mesh.group("pp"))
        raises(ValueError, "schedule 'zb-h1' splits backward into I and W, which experts "
               "split over tp", lambda: Pipeline(stage, "zb-h1", 2))
        mesh.free()
        raises(ValueError, "--schedule zb-h1 splits backward at modules' outputs, which "
               "experts split over --tp 2 do not have",
               lambda: check_layout(Layout(dp=1, pp=2, tp=2, experts=EXPERTS,
                                           schedule="zb-h1", microbatches=2), **sizes))
    layer = ExpertParallelMoE(MoE(8, 8, 2 * n, 1, group_rows=2), world)
    raises(ValueError, "a batch of 3 rows does not split into routing groups of group_rows=2",
           lambda: layer(torch.zeros(3, 4, 8)))


check.run_cases(globals())
