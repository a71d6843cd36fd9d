"""commlib_strategies.tensor_parallel under mpiexec, with tp = the world's size (and dp x tp = 2 x 2
at 4 ranks): each layer against its single-process counterpart (values and gradients), the
vocab-parallel embedding (``vocab_parallel_``, in place) and cross-entropy against one
process, and the GPT made tensor-parallel by ``parallelize`` with its plan training like the
single-process reference (1e-4 relative after 5 steps, fp32)."""
import torch
import torch.nn.functional as F
from torch import nn

import commlib
from harness import Checker, close, leaf, raises, same_as, use_device
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.mappings import gather_along
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import GPT, GPTConfig, cross_entropy
from commlib_strategies.parallelize import parallelize
from commlib_strategies.plans import PLANS
from commlib_strategies.zero import ZeRO
from commlib_strategies.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                gathered_state, vocab_parallel_,
                                                vocab_parallel_cross_entropy)

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()  # COMMLIB_TEST_DEVICE=cuda: on GPU 0

V = vocab_size()  # 13: padded to 14 at tp=2, 16 at tp=4
CONFIG = GPTConfig(vocab_size=V, seq_len=16, d_model=32, n_heads=4, n_layers=2)
DATA = AdditionDataset(seed=0)
BATCH, STEPS, SEED = 12, 5, 1


def data(salt, shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(salt)  # on the CPU: the same data on every device
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(DEVICE, dtype)


def linear(d_in, d_out, salt, bias=True):
    layer = nn.Linear(d_in, d_out, bias=bias).double()
    with torch.no_grad():
        layer.weight.copy_(data(salt, layer.weight.shape))
        if bias:
            layer.bias.copy_(data(salt + 1, layer.bias.shape))
    return layer


# ------------------------------------------------------------------------------ layers

def column_parallel_linear():
    for gather_output in (False, True):
        ref = linear(8, 4 * n, salt=1)
        layer = ColumnParallelLinear.from_linear(ref, world, gather_output=gather_output)
        assert layer.weight.shape == (4, 8) and layer.bias.shape == (4,)
        x, w = data(3, (3, 5, 8)), data(4, (3, 5, 4 * n))
        xr, xt = leaf(x), leaf(x)
        (ref(xr) * w).sum().backward()
        y = layer(xt)
        if gather_output:  # replicated: every rank computes the whole loss
            close(y.detach(), ref(x).detach())
            (y * w).sum().backward()
        else:  # split: each rank computes its part of the loss
            close(y.detach(), ref(x).detach().chunk(n, -1)[rank])
            (y * w.chunk(n, -1)[rank]).sum().backward()
        close(xt.grad, xr.grad)
        close(layer.weight.grad, ref.weight.grad.chunk(n, 0)[rank])
        close(layer.bias.grad, ref.bias.grad.chunk(n, 0)[rank])


def row_parallel_linear():
    for input_is_parallel in (False, True):
        ref = linear(4 * n, 6, salt=5)
        layer = RowParallelLinear.from_linear(ref, world, input_is_parallel=input_is_parallel)
        assert layer.weight.shape == (6, 4) and layer.bias.shape == (6,)
        x, w = data(7, (3, 5, 4 * n)), data(8, (3, 5, 6))
        xr = leaf(x)
        xt = leaf(x.chunk(n, -1)[rank] if input_is_parallel else x)
        (ref(xr) * w).sum().backward()
        y = layer(xt)
        close(y.detach(), ref(x).detach(), rtol=1e-10)  # the bias counted once
        (y * w).sum().backward()
        close(xt.grad, xr.grad.chunk(n, -1)[rank] if input_is_parallel else xr.grad)
        close(layer.weight.grad, ref.weight.grad.chunk(n, 1)[rank])
        close(layer.bias.grad, ref.bias.grad)


def fresh_layers_are_slices_of_one_layer():
    torch.manual_seed(11)
    want = nn.Linear(8, 4 * n)
    torch.manual_seed(11)
    col = ColumnParallelLinear(8, 4 * n, world)
    torch.manual_seed(11)
    row = RowParallelLinear(8, 4 * n, world)  # in_features 8 divides by 1, 2 and 4
    for layer in (col, row):
        full = gathered_state(layer, world)
        assert torch.equal(full["weight"], want.weight.detach())
        assert torch.equal(full["bias"], want.bias.detach())
    torch.manual_seed(11)
    want = nn.Embedding(V, 6)
    torch.manual_seed(11)
    emb = nn.Embedding(V, 6)
    vocab_parallel_(emb, world)
    assert emb.weight.shape == (-(-V // n), 6)
    assert torch.equal(gathered_state(emb, world)["weight"], want.weight.detach())


def vocab_parallel_embedding():
    ref = nn.Embedding(V, 6).double()
    with torch.no_grad():
        ref.weight.copy_(data(9, (V, 6)))
    layer = nn.Embedding(V, 6).double()
    with torch.no_grad():
        layer.weight.copy_(ref.weight)
    vocab_parallel_(layer, world)
    rows = -(-V // n)  # the vocab padded to a multiple of n, split
    assert layer.weight.shape == (rows, 6)
    idx = (torch.arange(3 * V) * 5 % V).view(3, V)  # every id, in a scrambled order
    w = data(10, (3, V, 6))
    y = layer(idx)
    close(y.detach(), ref(idx).detach())
    (y * w).sum().backward()
    (ref(idx) * w).sum().backward()
    close(gathered_state(layer, world, grads=True)["weight"], ref.weight.grad)
    pad = [i for i in range(rows) if rank * rows + i >= V]
    assert torch.equal(layer.weight.grad[pad], torch.zeros(len(pad), 6, dtype=torch.float64))


def padded_logits(logits, padded_vocab, fill):
    pad = torch.full(logits.shape[:-1] + (padded_vocab - logits.shape[-1],), fill,
                     dtype=logits.dtype)
    return torch.cat([logits, pad], -1)


def vocab_parallel_cross_entropy_against_model():
    # fp32 like the model: V = 13 padded; the padding's logits are large and must not count
    logits, targets = data(12, (3, 7, V), torch.float32), torch.arange(21).view(3, 7) % V
    full = leaf(logits)
    want = cross_entropy(full, targets)
    want.backward()
    vp = -(-V // n) * n
    local = leaf(padded_logits(logits, vp, 50.0).chunk(n, -1)[rank])
    got = vocab_parallel_cross_entropy(local, targets, world, vocab_size=V)
    got.backward()
    assert got.dtype == torch.float32
    close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    close(local.grad, padded_logits(full.grad, vp, 0.0).chunk(n, -1)[rank], rtol=1e-5, atol=1e-8)


def vocab_parallel_cross_entropy_float64_and_bfloat16():
    logits, targets = data(13, (4, 5, 3 * n)), data(14, (4, 5)).abs().mul(7).long() % (3 * n)
    full = leaf(logits)
    F.cross_entropy(full.flatten(0, 1), targets.flatten()).backward()
    local = leaf(logits.chunk(n, -1)[rank])
    loss = vocab_parallel_cross_entropy(local, targets, world)  # no padding
    loss.backward()
    assert loss.dtype == torch.float64
    close(loss.detach(), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    close(local.grad, full.grad.chunk(n, -1)[rank])
    half = leaf(logits.chunk(n, -1)[rank].to(torch.bfloat16))
    loss = vocab_parallel_cross_entropy(half, targets, world)
    loss.backward()
    assert loss.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    raises(ValueError, f"targets must lie in [0, {3 * n})",
           lambda: vocab_parallel_cross_entropy(local, targets + 3 * n, world))


# ------------------------------------------------------------------------------ the GPT

def tensor_parallel(model, mesh):
    """``model`` made tensor-parallel over the mesh's tp group, in place, by the GPT's plan."""
    return parallelize(model, mesh, PLANS["gpt"])


def optimizer(params):
    # SGD with momentum, not Adam: Adam blows rounding noise in gradients that are zero in
    # theory (the key bias) up to full-size steps
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches(steps=STEPS):
    return [DATA.batch(step, BATCH, CONFIG.seq_len) for step in range(steps)]


def _reference() -> dict:
    model = GPT(CONFIG, SEED)
    opt = optimizer(model.parameters())
    for x, y in batches():
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


REFERENCE = _reference()


def replicated_params_identical(model, group):
    """Parameters that every rank of ``group`` holds whole are bitwise the same on all."""
    for name, p in model.named_parameters():
        if getattr(p, "tp_split_dim", None) is None:
            everyone = torch.empty((group.size,) + p.shape)
            group.all_gather(everyone, p.detach().contiguous())
            assert all(torch.equal(everyone[0], e) for e in everyone), f"{name} differs"


def tp_gpt_forward_and_gradients():
    ref, model = GPT(CONFIG, SEED), GPT(CONFIG, SEED)
    mesh = Mesh(world, tp=n)
    rng = torch.get_rng_state()
    tensor_parallel(model, mesh)
    assert torch.equal(torch.get_rng_state(), rng)  # building draws nothing
    assert model.blocks[0].attn.n_heads == CONFIG.n_heads // n
    same_as(gathered_state(model, world), dict(ref.named_parameters()), rtol=0, atol=0)
    x, y = batches(1)[0]
    close(model(x).detach(), ref(x).detach(), rtol=1e-5, atol=1e-6)
    loss, want = model.loss(x, y), ref.loss(x, y)
    close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    loss.backward()
    want.backward()
    same_as(gathered_state(model, world, grads=True),
            {k: p.grad for k, p in ref.named_parameters()}, rtol=1e-4, atol=1e-7)
    mesh.free()


def tp_trains_like_one_process():
    mesh = Mesh(world, tp=n)
    model = tensor_parallel(GPT(CONFIG, SEED), mesh)
    opt = optimizer(model.parameters())
    for x, y in batches():
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    same_as(gathered_state(model, world), REFERENCE)
    replicated_params_identical(model, world)
    mesh.free()


def dp_x_tp_trains_like_one_process():
    if n % 2:
        return
    mesh = Mesh(world, dp=n // 2, tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    model = tensor_parallel(GPT(CONFIG, SEED), mesh)
    opt = optimizer(model.parameters())
    for x, y in batches():
        xs, ys = shard(x, mesh.rank("dp"), dp.size), shard(y, mesh.rank("dp"), dp.size)
        model.loss(xs, ys).backward()
        for p in model.parameters():
            dp.all_reduce(p.grad, op="avg")
        opt.step()
        opt.zero_grad()
    same_as(gathered_state(model, tp), REFERENCE)
    replicated_params_identical(model, tp)
    mesh.free()


def dp_x_tp_with_data_parallel_wrapper():
    if n % 2:
        return
    mesh = Mesh(world, dp=n // 2, tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    # each dp rank starts from another reference; DataParallel broadcasts dp rank 0's shards
    model = DataParallel(tensor_parallel(GPT(CONFIG, SEED + mesh.rank("dp")), mesh), dp)
    opt = optimizer(model.parameters())
    for x, y in batches():
        xs, ys = shard(x, mesh.rank("dp"), dp.size), shard(y, mesh.rank("dp"), dp.size)
        model.module.loss(xs, ys).backward()
        opt.step()
        opt.zero_grad()
    same_as(gathered_state(model.module, tp), REFERENCE)
    mesh.free()


def zero_x_tp_trains_like_one_process():
    """ZeRO 1-3 over the dp ranks of a tensor-parallel model (each dp rank shards its tp
    slice further)."""
    if n % 2:
        return
    mesh = Mesh(world, dp=n // 2, tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    for stage in (1, 2, 3):
        model = ZeRO(tensor_parallel(GPT(CONFIG, SEED + mesh.rank("dp")), mesh), dp, stage,
                     optimizer)
        for x, y in batches():
            xs, ys = shard(x, mesh.rank("dp"), dp.size), shard(y, mesh.rank("dp"), dp.size)
            model.module.loss(xs, ys).backward()
            model.step()
            model.zero_grad()
        local, full = model.full_parameters(), {}
        with torch.no_grad():
            for name, p in model.module.named_parameters():
                dim = getattr(p, "tp_split_dim", None)
                full[name] = local[name] if dim is None else gather_along(
                    local[name].contiguous(), tp, dim).narrow(dim, 0, p.tp_full_size)
        same_as(full, REFERENCE)
    mesh.free()


def errors():
    bad = GPTConfig(vocab_size=V, seq_len=8, d_model=24, n_heads=3, n_layers=1)
    if n > 1:
        mesh = Mesh(world, tp=n)
        raises(ValueError, f"tensor parallel: the model's n_heads=3 does not divide by tp={n}",
               lambda: tensor_parallel(GPT(bad, 0), mesh))
        mesh.free()
        raises(ValueError, f"out_features={4 * n + 1} is not divisible by tp={n}",
               lambda: ColumnParallelLinear(8, 4 * n + 1, world))
        raises(ValueError, f"in_features={4 * n + 1} is not divisible by tp={n}",
               lambda: RowParallelLinear.from_linear(nn.Linear(4 * n + 1, 8), world))


check.run_cases(globals())
