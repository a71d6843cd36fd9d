"""commlib_strategies.pipeline under mpiexec, with pp = the world's size (2 or 4), and pp=2 x dp=2
(plain, and ZeRO 1-3 on dp), pp=2 x tp=2 (plain, and Megatron SP), pp=2 x cp=2 (Ulysses
attention) at 4 ranks, each layout applied by parallelize with the GPT's plan: every schedule
trains the GPT like the single-process reference on the same global batches (losses and
gathered parameters after 5 steps, 1e-4 relative, fp32). Rank 0 prints each schedule's
measured idle fraction next to the simulated one."""
import sys

import torch

import commlib
from harness import Checker, raises, use_device
from harness import same_as as harness_same_as
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.parallelize import parallelize
from commlib_strategies.pipeline import Pipeline, PipelineStage, gathered_state
from commlib_strategies.pipeline_schedules import Action, schedule
from commlib_strategies.plans import PLANS
from commlib_strategies.sequence_parallel import sequence_shard
from commlib_strategies.tensor_parallel import gathered_state as tp_gathered_state
from commlib_strategies.zero import ZeRO

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()  # COMMLIB_TEST_DEVICE=cuda: on GPU 0

# 2n blocks: interleaving with 2 chunks per stage needs a block per piece
CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2 * n)
DATA = AdditionDataset(seed=0)
BATCH, MICRO, STEPS, SEED = 8, 4, 5, 1
PLAN = PLANS["gpt"]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]
measured = []  # lines rank 0 prints at the end


class Momentum:
    """SGD with momentum, torch.optim.SGD's rule written out: building a torch optimizer
    imports torch._dynamo, seconds of every rank's time. Not Adam: Adam blows rounding noise
    in gradients that are zero in theory (the key bias) up to full-size steps."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            b = self.buffers[i]
            b = p.grad.clone() if b is None else b.mul_(self.momentum).add_(p.grad)
            self.buffers[i] = b
            p.add_(b, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def optimizer(params):
    return Momentum(params)


def batches():
    return [DATA.batch(step, BATCH, CONFIG.seq_len) for step in range(STEPS)]


def _reference():
    model = GPT(CONFIG, SEED)
    opt = optimizer(model.parameters())
    losses = []
    for x, y in batches():
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


REFERENCE_LOSSES, REFERENCE = _reference()


def same_as(got: dict, want: dict = REFERENCE, **tolerances):
    harness_same_as(got, want, **tolerances)


def same_losses(got, want=REFERENCE_LOSSES):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: loss {g} != {w}"


def train(pipe, stage, shard_of=lambda t: t, after_backward=lambda: None):
    opt = optimizer(stage.parameters())
    losses = []
    for x, y in batches():
        losses.append(pipe.step(shard_of(x), shard_of(y)))
        after_backward()
        opt.step()
        opt.zero_grad()
    return losses


# ------------------------------------------------------------------------------ pp = n

def stage_holds_only_its_pieces():
    stage = PipelineStage(GPT(CONFIG, SEED), PLAN, world, virtual=2)
    names = {name for name, _ in stage.named_reference_parameters()}
    # 2n pieces of one block each: this stage holds blocks rank and rank + n
    blocks = {name.split(".")[1] for name in names if name.startswith("blocks.")}
    assert blocks == {str(rank), str(rank + n)}, blocks
    # each piece a copy of the model holding its block only, in the block's own place (the
    # others stand-ins without parameters)
    assert [(p.index, p.first, p.last, [k for k, b in p.model.blocks._modules.items()
                                        if list(b.parameters())]) for p in stage.pieces] \
        == [(rank, rank == 0, False, [str(rank)]),
            (rank + n, False, rank == n - 1, [str(rank + n)])]
    assert all(len(p.model.blocks) == 2 * n for p in stage.pieces)
    assert [(k, tuple(s)) for k, s in stage.layout[rank]] == \
        [(k, tuple(p.shape)) for k, p in stage.named_reference_parameters()]
    assert any(name.startswith("tok_emb.") for name in names) == (rank == 0)
    assert any(name.startswith("head.") for name in names) == (rank == n - 1)
    held = sum(p.numel() for p in stage.parameters())
    want = sum(REFERENCE[name].numel() for name in names)
    assert held == want, (held, want)  # nothing beyond its pieces
    full = gathered_state(stage)
    start = dict(GPT(CONFIG, SEED).named_parameters())
    assert full.keys() == start.keys() and all(torch.equal(full[k], start[k]) for k in full)


def trains_like_one_process(name, virtual):
    def case():
        stage = PipelineStage(GPT(CONFIG, SEED), PLAN, world, virtual=virtual)
        pipe = Pipeline(stage, name, MICRO)
        same_losses(train(pipe, stage))
        same_as(gathered_state(stage))
        r = pipe.report
        measured.append(f"pp={n} {name:16s} v={virtual} m={MICRO}: measured idle {r.bubble:.2f} "
                        f"(stages {' '.join(f'{i:.2f}' for i in r.idle)}), simulated with the "
                        f"measured costs {r.simulated_bubble:.2f} (stages "
                        f"{' '.join(f'{i:.2f}' for i in r.simulated_idle)}), with unit costs "
                        f"{pipe.simulation.bubble:.2f}")
    case.__name__ = f"pp={n} {name} v={virtual} trains like one process"
    return case


def gradients_accumulate_like_one_backward():
    """One step's gradients (no optimizer) against the reference's, for the split backward."""
    x, y = batches()[0]
    ref = GPT(CONFIG, SEED)
    ref.loss(x, y).backward()
    stage = PipelineStage(GPT(CONFIG, SEED), PLAN, world)
    Pipeline(stage, "zb-h1", MICRO, measure=False).step(x, y)
    same_as(gathered_state(stage, grads=True), {k: p.grad for k, p in ref.named_parameters()},
            rtol=1e-4, atol=1e-7)


def one_stage_pipeline_runs_locally():
    """A one-rank pipeline group: pieces hand tensors to each other without messages (rank 0
    alone; the cores are few)."""
    alone = world.split(rank)
    if rank == 0:
        for name, virtual in [("zb-h1", 1), ("interleaved-1f1b", 2)]:
            stage = PipelineStage(GPT(CONFIG, SEED), PLAN, alone, virtual=virtual)
            same_losses(train(Pipeline(stage, name, MICRO, measure=False), stage))
            same_as(gathered_state(stage))
    alone.free()


def custom_schedule():
    """A schedule given as data: 1f1b with stage 0's last two backwards swapped is still
    complete and deadlock-free, and trains the same."""
    actions = schedule("1f1b", n, MICRO)
    last_two = [i for i, a in enumerate(actions[0]) if a.kind in ("B", "RECV_B")][-4:]
    block = [actions[0][i] for i in last_two]
    for i, a in zip(last_two, block[2:] + block[:2]):
        actions[0][i] = a
    stage = PipelineStage(GPT(CONFIG, SEED), PLAN, world)
    same_losses(train(Pipeline(stage, actions, MICRO, measure=False), stage))
    same_as(gathered_state(stage))


def errors():
    stage = PipelineStage(GPT(CONFIG, SEED), PLAN, world)
    raises(ValueError, "does not divide into 4 microbatches",
           lambda: Pipeline(stage, "1f1b", MICRO).step(*DATA.batch(0, 6, CONFIG.seq_len)))
    raises(ValueError, f"need at least {4 * n} blocks",
           lambda: PipelineStage(GPT(CONFIG, SEED), PLAN, world, virtual=4))
    raises(ValueError, "not one for", lambda: Pipeline(stage, schedule("1f1b", n, 2), MICRO))
    raises(ValueError, "unknown pipeline schedule", lambda: Pipeline(stage, "2f2b", MICRO))
    bad = schedule("1f1b", n, MICRO)
    bad[0] = [a for a in bad[0] if a != Action(0, "B", 1)]
    raises(ValueError, "missing B1@0", lambda: Pipeline(stage, bad, MICRO))


# ------------------------------------------------------------------------------ 2 x 2

def pp_x_dp_trains_like_one_process():
    """pp=2 x dp=2: each dp replica pipelines half the batch; gradients averaged over dp by
    the pipeline (overlapping the schedule) or by hand after the step."""
    mesh = Mesh(world, pp=2, dp=2)
    dp = mesh.group("dp")

    def half(t):
        return shard(t, mesh.rank("dp"), 2)
    for name, by_hand in [("zb-h1", False), ("1f1b", True)]:
        stage = PipelineStage(GPT(CONFIG, SEED), PLAN, mesh.group("pp"))
        pipe = Pipeline(stage, name, MICRO // 2, dp_group=None if by_hand else dp,
                        measure=False)

        def average():
            if by_hand:
                for p in stage.parameters():
                    dp.all_reduce(p.grad, op="avg")
        losses = train(pipe, stage, half, average)
        mean = torch.tensor(losses, dtype=torch.float64)
        dp.all_reduce(mean, op="avg")
        same_losses(mean.tolist())
        same_as(gathered_state(stage))
    mesh.free()


def pp_x_dp_with_zero_trains_like_one_process():
    """pp=2 x dp=2 with ZeRO on each stage's dp group: stage 1 reduce-scatters in its step,
    2 and 3 as the pipeline finds each chunk's gradients final (no full gradient is left
    after the schedule); stage 3 keeps only shards between steps."""
    mesh = Mesh(world, pp=2, dp=2)
    dp = mesh.group("dp")

    def half(t):
        return shard(t, mesh.rank("dp"), 2)
    for zero_stage, name, virtual in [(1, "1f1b", 1), (2, "zb-h1", 1), (3, "zb-h1", 1),
                                      (3, "interleaved-1f1b", 2)]:
        stage = PipelineStage(GPT(CONFIG, SEED), PLAN, mesh.group("pp"), virtual)
        zero = ZeRO(stage, dp, zero_stage, optimizer, reduce_in_backward=False)
        pipe = Pipeline(stage, name, MICRO // 2, gradients=zero if zero_stage > 1 else None,
                        measure=False)
        losses = []
        for x, y in batches():
            losses.append(pipe.step(half(x), half(y)))
            grads = [p.grad for p in stage.parameters()]
            assert all(g is None for g in grads) == (zero_stage > 1), zero_stage
            zero.step()
            zero.zero_grad()
            if zero_stage == 3:
                assert all(p.numel() == 0 for p in stage.parameters())
        mean = torch.tensor(losses, dtype=torch.float64)
        dp.all_reduce(mean, op="avg")
        same_losses(mean.tolist())
        held = sum(p.numel() for p in stage.parameters()) if zero_stage < 3 else \
            sum(u.numel for u in zero.units)
        assert zero.master.numel() <= held // 2 + len(zero.units), (zero.master.numel(), held)
        with zero.gathered():
            same_as(gathered_state(stage))
    mesh.free()


def _whole_state(stage, mesh, sp=None) -> dict:
    """The stage's gathered parameters with their tensor-parallel shards joined: loaded into
    a model parallelized like the stage's (every stage's parameters, with their
    ``tp_split_dim``), whose tensor-parallel gathered state joins them."""
    model = parallelize(GPT(CONFIG, SEED), mesh, PLAN, sp=sp)
    state = gathered_state(stage)
    params = dict(model.named_parameters())
    assert state.keys() == params.keys(), sorted(set(state) ^ set(params))
    with torch.no_grad():
        for k, p in params.items():
            assert state[k].shape == p.shape, (k, state[k].shape, p.shape)
            p.copy_(state[k])
    return tp_gathered_state(model, mesh.group("tp"))


def pp_x_tp_with_megatron_sp_trains_like_one_process():
    """pp=2 x tp=2 with Megatron SP, under 1f1b and zero-bubble's split backward: stages pass
    each other whole sequences (the last piece's final norm gathers them, a later piece's
    first block shards them again: by the bytes the pp group sends), and train like one
    process."""
    mesh = Mesh(world, pp=2, tp=2)
    pp = mesh.group("pp")
    for name in ("1f1b", "zb-h1"):
        stage = PipelineStage(parallelize(GPT(CONFIG, SEED), mesh, PLAN, sp="megatron"), PLAN, pp)
        pipe = Pipeline(stage, name, MICRO, measure=False)
        before = pp.bytes_sent
        same_losses(train(pipe, stage))
        _sent_hidden_states(pp, before, CONFIG.seq_len)
        same_as(_whole_state(stage, mesh, "megatron"))
    mesh.free()


def _sent_hidden_states(pp, before, time):
    """Each microbatch sent its hidden states forward, their gradient backward, ``time``
    tokens each (B/m, time, d); besides, the stages all-reduce each step's loss (a
    float64)."""
    message_bytes = (BATCH // MICRO) * time * CONFIG.d_model * 4
    extra = pp.bytes_sent - before - STEPS * MICRO * message_bytes
    assert 0 <= extra <= 8 * STEPS, extra


def pp_x_cp_trains_like_one_process():
    """pp=2 x cp=2: stages of the context-parallel GPT take and pass each cp rank's sequence
    shard, here Ulysses attention under zb-h1's split backward (ring attention under 1f1b:
    the training CLI's test)."""
    mesh = Mesh(world, pp=2, cp=2)
    cp, pp = mesh.group("cp"), mesh.group("pp")
    stage = PipelineStage(parallelize(GPT(CONFIG, SEED), mesh, PLAN, sp="ulysses"), PLAN, pp)
    pipe = Pipeline(stage, "zb-h1", MICRO, measure=False)
    before = pp.bytes_sent
    same_losses(train(pipe, stage, lambda t: sequence_shard(t, cp)))
    _sent_hidden_states(pp, before, CONFIG.seq_len // 2)
    same_as(gathered_state(stage))
    mesh.free()


def pp_x_tp_trains_like_one_process():
    """pp=2 x tp=2: the pipeline's stages are tensor-parallel GPT pieces, under the split
    backward (the weight-gradient pass must not communicate: the input-gradient pass did)."""
    mesh = Mesh(world, pp=2, tp=2)
    tp = mesh.group("tp")
    stage = PipelineStage(parallelize(GPT(CONFIG, SEED), mesh, PLAN), PLAN, mesh.group("pp"))
    pipe = Pipeline(stage, "zb-h1", MICRO, measure=False)
    sent, weights = [], pipe._w

    def counted(action):
        before = tp.bytes_sent
        weights(action)
        sent.append(tp.bytes_sent - before)
    pipe._w = counted
    same_losses(train(pipe, stage))
    assert len(sent) == STEPS * MICRO and not any(sent), sent
    same_as(_whole_state(stage, mesh))
    mesh.free()


CASES = [stage_holds_only_its_pieces, *(trains_like_one_process(*s) for s in SCHEDULES)]
# the suite's time is short: at 2 ranks the single-pipeline extras, at 4 the 2 x 2 meshes
CASES += [pp_x_dp_trains_like_one_process, pp_x_tp_trains_like_one_process,
          pp_x_dp_with_zero_trains_like_one_process,
          pp_x_tp_with_megatron_sp_trains_like_one_process,
          pp_x_cp_trains_like_one_process] if n == 4 else \
    [gradients_accumulate_like_one_backward, one_stage_pipeline_runs_locally, custom_schedule,
     errors]
for fn in CASES:
    if not sys.argv[1:] or any(word in fn.__name__ for word in sys.argv[1:]):  # by hand: a subset
        check.check(fn.__name__, fn)
if rank == 0:
    print("\n".join(measured), flush=True)
check.finish()
