"""DataParallel and ZeRO 1-3 on models nobody here wrote (transformers' GPT-2 with its tied
lm_head, Llama, Mixtral; Qwen3 and Phi-3 by their configs' own plans; skipped without
transformers) and on a model built to do what real models do to a naive ZeRO; tensor,
context (Ulysses, ring) and, for Mixtral, dropless expert parallelism on the families by
their plans, with DP or ZeRO over the rest. Each trains a few steps on the same global
batches as one process does, and must end with the same parameters (1e-4 relative, fp32).
Under mpiexec."""
import contextlib
import fnmatch
import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from harness import Checker
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.mappings import gather_along
from commlib_strategies.mesh import Mesh
from commlib_strategies.expert_parallel import data_shard, reduce_gradients, zero_arguments
from commlib_strategies.model import GPT, GPTConfig, cross_entropy
from commlib_strategies.parallelize import parallelize
from commlib_strategies.config_plans import from_config
from commlib_strategies.plans import PLANS
from commlib_strategies.sequence_parallel import sequence_shard
from commlib_strategies.tensor_parallel import gathered_state
from commlib_strategies.zero import ZeRO

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()

DATA = AdditionDataset(seed=0)
BATCH, STEPS, SEQ, SEED = 12, 3, 16, 1  # 12 divides by 1..4 ranks


class Awkward(nn.Module):
    """A nested tree whose list holds one block twice (shared parameters), a buffer, an
    output layer tied to the embedding, and parameters the model reads outside their
    modules' forward (the embedding's weight, a block's bias)."""

    def __init__(self, seed: int, d: int = 16):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size(), d)
            shared = nn.Linear(d, d)
            self.body = nn.Module()
            self.body.layers = nn.ModuleList([nn.Linear(d, d), shared, nn.Linear(d, d), shared])
            self.norm = nn.LayerNorm(d)
            self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for layer in self.body.layers:
            x = x + torch.tanh(layer(x))
        return F.linear(self.norm(x), self.embed.weight) + self.body.layers[0].bias.sum()


# stage 3 holds (gathers for the whole forward and backward) only what it must: the root
# unit (parameters of no unit, or shared) and units read outside their forward
HELD = {"awkward": ["", "body.layers.0", "embed"], "gpt": [], "gpt2": [""], "llama": [],
        "mixtral": [], "qwen3": [], "phi3": []}


def models():
    yield "awkward", lambda: Awkward(SEED)
    # the project's GPT: one model with a plan, the same way as the families
    yield "gpt", lambda: GPT(GPTConfig(vocab_size(), seq_len=SEQ, d_model=32, n_heads=4,
                                       n_layers=2), SEED)
    if importlib.util.find_spec("transformers"):
        from commlib_strategies.families import FAMILIES, build
        for family in FAMILIES:
            yield family, lambda family=family: build(family, vocab_size(), SEED, seq_len=SEQ)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches():
    return [DATA.batch(step, BATCH, SEQ) for step in range(STEPS)]


def reference(make) -> dict:
    model = make()
    opt = optimizer(model.parameters())
    for x, y in batches():
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def same(named, want):
    for name, p in named:
        w = want[name].detach()
        assert torch.allclose(p.detach(), w, rtol=1e-4, atol=1e-6), \
            f"{name}: max diff {(p.detach() - w).abs().max():.3g}"
    assert {name for name, _ in named} == set(want), "not every parameter was compared"


def data_parallel(make, want):
    model = DataParallel(make(), world, bucket_bytes=4 << 10)
    opt = optimizer(model.parameters())
    for x, y in batches():
        cross_entropy(model(shard(x, rank, n)), shard(y, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    same(list(model.module.named_parameters()), want)


def zero(name, make, want, stage):
    model = ZeRO(make(), world, stage, optimizer)
    for x, y in batches():
        cross_entropy(model(shard(x, rank, n)), shard(y, rank, n)).backward()
        model.step()
        model.zero_grad()
    if stage == 3:  # only shards are kept between steps
        assert all(p.numel() == 0 for p in model.module.parameters())
        paths = {m: path for path, m in model.module.named_modules()}
        held = sorted(paths[u.module] for u in model.units if u.held)
        assert held == HELD[name], held
    same(list(model.full_parameters().items()), want)
    return model


def parallel(plan, make, want, sizes, zero_stage, attention="ring"):
    """The family's model parallelized by its plan over a mesh of ``sizes`` (tp, cp, ep; dp
    is the rest), with ZeRO ``zero_stage`` over dp (0: DataParallel, or with experts
    expert_parallel.reduce_gradients)."""
    mesh = Mesh(world, dp=n // math.prod(sizes.values()), **sizes)
    dp, tp, ep = mesh.group("dp"), mesh.group("tp"), mesh.group("ep")
    model = make()
    parallelize(model, mesh, plan, sp=attention)
    times = []  # under Megatron SP the blocks run on sequence shards
    first = plan.sequence[0]
    for path, m in model.named_modules():
        if fnmatch.fnmatch(path, first):
            m.register_forward_hook(lambda m, args, out: times.append(
                (out[0] if isinstance(out, tuple) else out).shape[1]))
    if sizes.get("tp", 1) > 1:
        assert any(hasattr(p, "tp_split_dim") for p in model.parameters()), "nothing split"
    experts = ep.size > 1
    if zero_stage:
        groups = zero_arguments(model, mesh) if experts else {"group": dp}
        wrapped = ZeRO(model, stage=zero_stage, optimizer=optimizer, **groups)
    else:
        wrapped = model if experts else DataParallel(model, dp)
    opt = wrapped if zero_stage else optimizer(model.parameters())
    for x, y in batches():
        if experts:  # every dp x ep rank sees its own rows
            x, y = data_shard(x, mesh), data_shard(y, mesh)
        else:
            x, y = (shard(t, mesh.rank("dp"), dp.size) for t in (x, y))
        if mesh.size("cp") > 1:
            x, y = (sequence_shard(t, mesh.group("cp")) for t in (x, y))
        model.loss(x, y).backward()
        if attention == "megatron":
            assert times.pop() == x.shape[1] // tp.size, "the blocks did not run on shards"
        if experts and not zero_stage:
            reduce_gradients(model, mesh)
        opt.step()
        opt.zero_grad()
    with wrapped.gathered() if zero_stage else contextlib.nullcontext():
        state = gathered_state(model, tp)
        for key, p in model.named_parameters():  # each ep rank's experts, stacked
            if getattr(p, "expert_parallel", False):
                state[key] = gather_along(p.detach(), ep, 0)
        same(list(state.items()), want)
    mesh.free()


# (sizes, ZeRO stage, attention) at 2 ranks; at 4 the rest is dp, and tp x cp joins;
# expert parallelism where there are experts
LAYOUTS = [({"tp": 2}, 0, None), ({"tp": 2}, 3, None), ({"tp": 2}, 1, "megatron"),
           ({"cp": 2}, 0, "ulysses"), ({"cp": 2}, 3, "ring")]
LAYOUTS_4 = [({"tp": 2, "cp": 2}, 0, "ring"), ({"tp": 2, "cp": 2}, 2, "ulysses"),
             ({"tp": 2}, 3, "megatron")]
EXPERT_LAYOUTS = [({"ep": 2}, 0, None), ({"ep": 2}, 3, None)]
EXPERT_LAYOUTS_4 = [({"ep": 2, "cp": 2}, 2, "ring"), ({"ep": 2, "tp": 2}, 0, None),
                    ({"ep": 2, "tp": 2}, 3, "megatron")]


def plan_of(name, make):
    """The hand-written plan, or the one the family's transformers config carries (Qwen3's:
    its q and k norms see each tp rank's heads only; Phi-3's: its fused projections
    gathered whole); None for a model without one."""
    if name in PLANS:
        return PLANS[name]
    return from_config(make()) if name in CONFIG_PLANNED else None


def layouts(plan):
    if n % 2:
        return []
    more = EXPERT_LAYOUTS + (EXPERT_LAYOUTS_4 if n == 4 else []) if plan.experts else []
    return LAYOUTS + (LAYOUTS_4 if n == 4 else []) + more


def as_transformers_built():
    """Qwen2, which the project names nowhere else, as transformers builds it, its LM head
    tied to its embedding (both split over the vocab: one parameter still)."""
    import transformers as tf
    config = tf.Qwen2Config(vocab_size=vocab_size(), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=SEQ, attn_implementation="eager",
                            tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return tf.AutoModelForCausalLM.from_config(config)


def parallelized_as_built(want):
    """parallelize takes a transformers model as transformers built it, plans it by its
    config and returns it wrapped: tp=2 (dp over the rest) trains like one process."""
    mesh = Mesh(world, dp=n // 2, tp=2)
    model = parallelize(as_transformers_built(), mesh)
    DataParallel(model, mesh.group("dp"))  # (its hooks average the gradients over dp)
    opt = optimizer(model.parameters())
    for x, y in batches():
        x, y = (shard(t, mesh.rank("dp"), mesh.size("dp")) for t in (x, y))
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert any(hasattr(p, "tp_split_dim") for p in model.parameters()), "nothing split"
    head, embedding = model.hf.get_output_embeddings(), model.hf.get_input_embeddings()
    assert head.weight is embedding.weight and hasattr(head.weight, "tp_split_dim")
    same(list(gathered_state(model, mesh.group("tp")).items()), want)
    mesh.free()


# families planned by their configs: what is new there is the plan (DP and ZeRO do not read
# it), so only the layouts that use it run
CONFIG_PLANNED = ("qwen3", "phi3")

for name, make in models():
    if name in CONFIG_PLANNED and not layouts(plan_of(name, make)):
        continue
    want = reference(make)
    if name not in CONFIG_PLANNED:
        check.check(f"{name}_data_parallel", lambda: data_parallel(make, want))
        for stage in (1, 2, 3):
            check.check(f"{name}_zero_{stage}", lambda: zero(name, make, want, stage))
    if plan := plan_of(name, make):
        for sizes, stage, attention in layouts(plan):
            label = "_".join(f"{d}{s}" for d, s in sizes.items())
            check.check(f"{name}_{label}_zero_{stage}_{attention}",
                        lambda: parallel(plan, make, want, sizes, stage, attention))
if importlib.util.find_spec("transformers") and n % 2 == 0:
    from commlib_strategies.families import causal_lm
    want = reference(lambda: causal_lm(as_transformers_built()))
    check.check("qwen2_as_transformers_built_tp2", lambda: parallelized_as_built(want))
check.finish()

