"""DataParallel and ZeRO 1-3 on models nobody here wrote (transformers' GPT-2 with its tied
lm_head, Llama, Mixtral; skipped without transformers) and on a model built to do what real
models do to a naive ZeRO; tensor parallelism on the families by their plans, alone and with
DP or ZeRO 3 over the rest: each trains a few steps on the same global batches as one
process does, and must end with the same parameters (1e-4 relative, fp32). Under mpiexec."""
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from harness import Checker
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import cross_entropy
from commlib_strategies.parallelize import parallelize
from commlib_strategies.plans import PLANS
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
HELD = {"awkward": ["", "body.layers.0", "embed"], "gpt2": [""], "llama": [], "mixtral": []}


def models():
    yield "awkward", lambda: Awkward(SEED)
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


def tensor_parallel(name, make, want, zero_stage):
    """tp=2 by the family's plan; dp over the other ranks, with ZeRO ``zero_stage`` (0: DP)."""
    mesh = Mesh(world, dp=n // 2, tp=2)
    dp, tp = mesh.group("dp"), mesh.group("tp")
    model = make()
    parallelize(model, mesh, PLANS[name], config=model.hf.config)
    local = {p for p in model.parameters() if hasattr(p, "tp_split_dim")}
    assert local, "the plan split no parameter"
    wrapped = ZeRO(model, dp, zero_stage, optimizer) if zero_stage else DataParallel(model, dp)
    opt = wrapped if zero_stage else optimizer(model.parameters())
    for x, y in batches():
        cross_entropy(wrapped(shard(x, mesh.rank("dp"), dp.size)),
                      shard(y, mesh.rank("dp"), dp.size)).backward()
        opt.step()
        opt.zero_grad()
    if zero_stage:
        with wrapped.gathered():
            same(list(gathered_state(model, tp).items()), want)
    else:
        same(list(gathered_state(model, tp).items()), want)
    mesh.free()


for name, make in models():
    want = reference(make)
    check.check(f"{name}_data_parallel", lambda: data_parallel(make, want))
    for stage in (1, 2, 3):
        check.check(f"{name}_zero_{stage}", lambda: zero(name, make, want, stage))
    if name in PLANS and n % 2 == 0:
        for stage in (0, 3):
            check.check(f"{name}_tp2_zero_{stage}",
                        lambda: tensor_parallel(name, make, want, stage))
check.finish()
