"""commlib_strategies.sequence_parallel under mpiexec at 2 and 4 ranks: ring and Ulysses attention
against plain causal attention over the world (forward and backward, float64); the GPT made
Megatron-SP, Ulysses and ring by ``parallelize`` with its plan, against the single-process
reference on the same global batches (first step's logits and gradients, every step's loss,
parameters after 5 steps within 1e-4 relative, fp32): at 2 ranks each over the world (tp 2,
cp 2); at 4 ranks ring over cp 4, and each beside dp 2 (tp 2 x dp 2 through DataParallel and
through ZeRO-3, cp 2 x dp 2 through DataParallel for Ulysses and an explicit all-reduce for
ring, and cp 2 x tp 2 for both: each tp rank's heads attend across the cp shards); and the
activation bytes each layout saves per layer against their accounting (commlib_bench.activations,
whose table rank 0 prints)."""
import torch
import torch.nn.functional as F

import commlib
from commlib_bench.activations import LAYOUTS, accounted_bytes, format_table, table
from harness import Checker, leaf, raises, same_as, use_device
from harness import close as harness_close
from commlib_strategies.attention import PLAIN, Scoring
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.mappings import gather_along
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.context_parallel import (context_parallel_, ring_attention,
                                                 ulysses_attention)
from commlib_strategies.parallelize import parallelize
from commlib_strategies.plans import PLANS
from commlib_strategies.sequence_parallel import sequence_shard
from commlib_strategies.tensor_parallel import gathered_state
from commlib_strategies.zero import ZeRO

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()  # COMMLIB_TEST_DEVICE=cuda: on GPU 0

CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2)
DATA = AdditionDataset(seed=0)
BATCH, STEPS, SEED = 4, 5, 1


def data(salt, shape):
    g = torch.Generator().manual_seed(salt)  # on the CPU: the same data on every device
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(DEVICE)


def close(got, want, rtol=1e-10, atol=1e-12):
    harness_close(got, want, rtol, atol)


# ------------------------------------------------------------------------------ attention

def attention_cores_match_causal_attention():
    """Each rank's queries attend to the whole sequence's earlier keys; gradients of q, k and
    v shards are the shards of the full gradients (float64)."""
    heads, time = 2 * n, 3 * n  # 3 tokens per rank: the causal mask cuts inside blocks
    q, k, v, w = (data(salt, (2, heads, time, 8)) for salt in (1, 2, 3, 4))
    full = [leaf(t) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    (want * w).sum().backward()

    def mine(t):
        return t.chunk(n, 2)[rank]
    for core in (ring_attention, ulysses_attention):
        local = [leaf(mine(t)) for t in (q, k, v)]
        got = core(*local, group=world)
        close(got.detach(), mine(want.detach()))
        (got * mine(w)).sum().backward()
        for got_grad, want_grad in zip(local, full):
            close(got_grad.grad, mine(want_grad.grad))


def _attention_written_out(q, k, v, scoring, sinks):
    """Whole-sequence attention as the models' eager code does it: logits, cap, mask, a
    sink column in the softmax, dropped."""
    logits = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scoring.scale is None
                                        else scoring.scale)
    if scoring.softcap:
        logits = scoring.softcap * torch.tanh(logits / scoring.softcap)
    query, key = torch.arange(q.shape[-2]).unsqueeze(1), torch.arange(k.shape[-2])
    seen = (key <= query) & ((query - key < scoring.window) if scoring.window else True)
    logits = logits.masked_fill(~seen.to(logits.device), float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)], -1)
    probs = logits.softmax(-1)
    return (probs[..., :-1] if sinks is not None else probs) @ v


def attention_cores_score_as_models_do():
    """Logits scaled otherwise than by 1/sqrt(head_dim), soft-capped, a sliding window
    within a rank's block of 3 tokens and across blocks (at 4 ranks the window of 2 skips
    whole blocks), and learned sinks: ring and Ulysses against whole-sequence attention
    written out, forward and the gradients of q, k, v and the sinks (float64)."""
    heads, time = 2 * n, 3 * n
    q, k, v, w = (data(salt, (2, heads, time, 8)) for salt in (11, 12, 13, 14))
    sinks = data(15, (heads,))

    def mine(t):
        return t.chunk(n, 2)[rank]
    for scoring, sunk in ((Scoring(scale=0.3), False), (Scoring(softcap=1.5), False),
                          (Scoring(window=2), False), (Scoring(window=4), True),
                          (Scoring(scale=1.0, softcap=2.0, window=5), True), (PLAIN, True)):
        full = [leaf(t) for t in (q, k, v, sinks)]
        want = _attention_written_out(*full[:3], scoring, full[3] if sunk else None)
        (want * w).sum().backward()
        for core in (ring_attention, ulysses_attention):
            local = [leaf(mine(t)) for t in (q, k, v)] + [leaf(sinks)]
            got = core(*local[:3], group=world, scoring=scoring,
                       sinks=local[3] if sunk else None)
            close(got.detach(), mine(want.detach()))
            (got * mine(w)).sum().backward()
            for got_grad, want_grad in zip(local[:3], full[:3]):
                close(got_grad.grad, mine(want_grad.grad))
            if sunk:  # each rank's queries' part of the sinks' gradient, summed here
                total = local[3].grad.clone()
                world.all_reduce(total)
                close(total, full[3].grad)


def ring_attention_float32_and_bfloat16():
    q, k, v = (data(salt, (1, 2, 4 * n, 8)) for salt in (5, 6, 7))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).chunk(n, 2)[rank]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        local = [leaf(t.chunk(n, 2)[rank].to(dtype)) for t in (q, k, v)]
        got = ring_attention(*local, group=world)
        assert got.dtype == dtype
        close(got.detach().double(), want, rtol=tol, atol=tol)
        got.sum().backward()
        assert all(t.grad.dtype == dtype for t in local)


# ------------------------------------------------------------------------------ the GPTs

def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches(steps=STEPS):
    return [DATA.batch(step, BATCH, CONFIG.seq_len) for step in range(steps)]


def state(model, grads=False) -> dict:
    """name -> a copy of the parameter (or its gradient) this rank holds."""
    return {k: (p.grad if grads else p).detach().clone() for k, p in model.named_parameters()}


def _reference() -> dict:
    """The single-process run every layout must reproduce: its losses, the logits and
    gradients of the first step, and the parameters after the last."""
    model = GPT(CONFIG, SEED)
    opt = optimizer(model.parameters())
    run = {"losses": []}
    for step, (x, y) in enumerate(batches()):
        loss = model.loss(x, y)
        loss.backward()
        if step == 0:
            run["logits"], run["grads"] = model(x).detach(), state(model, grads=True)
        run["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    run["params"] = state(model)
    return run


REFERENCE = _reference()


def identical_over(group, tensors: dict):
    """Every rank of ``group`` holds bitwise the same tensors."""
    for name, t in tensors.items():
        everyone = torch.empty((group.size,) + t.shape, dtype=t.dtype)
        group.all_gather(everyone, t.contiguous())
        assert all(torch.equal(everyone[0], e) for e in everyone), f"{name} differs"


def trains_like_one_process(model, part, full_state=state, after_backward=lambda: None,
                            batch_loss=lambda loss: loss.item()):
    """Five steps of ``model`` against the reference. ``part(t)``: this rank's part of a
    global batch tensor (ids, targets, the reference's logits); ``full_state(model,
    grads=)``: whole tensors; ``batch_loss``: the global batch's loss from this rank's.
    Checked: the first step's logits and gradients, every step's loss, the parameters
    after the last step."""
    opt = optimizer(model.parameters())
    for step, (x, y) in enumerate(batches()):
        if step == 0:
            with torch.no_grad():
                close(model(part(x)), part(REFERENCE["logits"]), rtol=1e-5, atol=1e-6)
        loss = model.loss(part(x), part(y))
        loss.backward()
        after_backward()
        got, want = batch_loss(loss.detach()), REFERENCE["losses"][step]
        assert abs(got - want) <= 1e-5 * want, f"step {step}: loss {got} != {want}"
        if step == 0:
            same_as(full_state(model, grads=True), REFERENCE["grads"], rtol=1e-4, atol=1e-7)
        opt.step()
        opt.zero_grad()
    same_as(full_state(model), REFERENCE["params"])


def train(model, dp, part, full_state=state, wrap_dp=False):
    """``trains_like_one_process`` for ``model`` alone, or beside data parallelism over
    ``dp``: each dp rank takes its rows of the batch (then ``part``), and the gradients are
    averaged over dp by the DataParallel wrapper (``wrap_dp``), else after backward."""
    if dp is None:
        return trains_like_one_process(model, part, full_state)

    def average():
        for p in model.parameters():
            dp.all_reduce(p.grad, op="avg")

    def dp_mean(loss):
        total = loss.reshape(1).clone()
        dp.all_reduce(total, op="avg")
        return total.item()
    if wrap_dp:
        DataParallel(model, dp)  # it lives on in the parameters' hooks
    trains_like_one_process(model, lambda t: part(shard(t, dp.rank, dp.size)), full_state,
                            after_backward=(lambda: None) if wrap_dp else average,
                            batch_loss=dp_mean)


def gpt(mesh, sp):
    """The reference GPT parallelized over ``mesh`` by its plan, with ``sp``."""
    return parallelize(GPT(CONFIG, SEED), mesh, PLANS["gpt"], sp=sp)


def layouts(group_dim):
    """Mesh sizes: ``group_dim`` over the world; at 4 ranks also 2 x dp 2 (the last)."""
    return [{group_dim: n}] + ([{group_dim: 2, "dp": 2}] if n == 4 else [])


def meshes(group_dim, sizes):
    """(mesh, its ``group_dim`` group, its dp group or None) for each of ``sizes``; each
    mesh is freed when the loop moves past it."""
    for size in sizes:
        mesh = Mesh(world, **size)
        yield mesh, mesh.group(group_dim), mesh.group("dp") if mesh.size("dp") > 1 else None
        mesh.free()


def megatron_sp_trains_like_one_process():
    """tp = 2, and at 4 ranks tp = 2 x dp = 2 through DataParallel (the tp hooks then the dp
    buckets)."""
    for mesh, tp, dp in meshes("tp", layouts("tp")[-1:]):
        model = gpt(mesh, "megatron")
        train(model, dp, part=lambda t: t, wrap_dp=True,
              full_state=lambda m, grads=False: gathered_state(m, tp, grads=grads))
        identical_over(tp, {k: p.detach() for k, p in model.named_parameters()
                            if getattr(p, "tp_split_dim", None) is None})  # held whole


def megatron_sp_under_zero3():
    """tp = 2 x ZeRO-3 over dp = 2 (4 ranks): ZeRO gathers each module before its forward, so
    the model must call its modules rather than use their parameters directly."""
    if n != 4:
        return
    mesh = Mesh(world, dp=2, tp=2)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    model = ZeRO(gpt(mesh, "megatron"), dp, 3, optimizer)
    for step, (x, y) in enumerate(batches()):
        loss = model.module.loss(shard(x, dp.rank, dp.size), shard(y, dp.rank, dp.size))
        loss.backward()
        model.step()
        model.zero_grad()
        mean = loss.detach().reshape(1)
        dp.all_reduce(mean, op="avg")
        want = REFERENCE["losses"][step]
        assert abs(mean.item() - want) <= 1e-5 * want, f"step {step}: {mean.item()} != {want}"
    local, full = model.full_parameters(), {}
    for name, p in model.module.named_parameters():
        dim = getattr(p, "tp_split_dim", None)
        full[name] = local[name] if dim is None else gather_along(
            local[name].contiguous(), tp, dim).narrow(dim, 0, p.tp_full_size)
    same_as(full, REFERENCE["params"])
    mesh.free()


def ulysses_trains_like_one_process():
    """cp = 2, and at 4 ranks cp = 2 x dp = 2 through DataParallel."""
    for mesh, cp, dp in meshes("cp", layouts("cp")[-1:]):
        model = gpt(mesh, "ulysses")
        train(model, dp, part=lambda t: sequence_shard(t, cp), wrap_dp=True)
        identical_over(world, state(model))


def cp_x_tp_trains_like_one_process():
    """cp = 2 x tp = 2 (4 ranks): each tp rank's heads attend across the cp group's sequence
    shards, by Ulysses and by ring attention."""
    if n != 4:
        return
    mesh = Mesh(world, cp=2, tp=2)
    cp, tp = mesh.group("cp"), mesh.group("tp")
    for attention in ("ulysses", "ring"):
        model = gpt(mesh, attention)
        trains_like_one_process(model, part=lambda t: sequence_shard(t, cp),
                                full_state=lambda m, grads=False: gathered_state(m, tp,
                                                                                 grads=grads))
        identical_over(cp, state(model))
    mesh.free()


def ring_trains_like_one_process():
    """cp = the world (2 or 4: blocks travel several hops), and at 4 ranks cp = 2 x dp = 2
    with gradients averaged over dp after backward."""
    for mesh, cp, dp in meshes("cp", layouts("cp")):
        model = gpt(mesh, "ring")
        train(model, dp, part=lambda t: sequence_shard(t, cp))
        identical_over(world, state(model))


# ------------------------------------------------------------------------------ memory

def activation_bytes_match_their_accounting():
    """Bytes saved per layer in every layout equal the accounting in commlib_bench.activations (the
    seed's formula without dropout, plus LayerNorm statistics), at t = cp = n."""
    config = GPTConfig(vocab_size=vocab_size(), seq_len=8 * n, d_model=32, n_heads=4, n_layers=1)
    rows = table(config, 2, world)
    assert [r["layout"] for r in rows] == list(LAYOUTS)
    for r in rows:
        want = accounted_bytes(r["layout"], config.seq_len, 2, config.d_model, config.n_heads, n)
        assert r["measured"] == want, f"{r['layout']}: measured {r['measured']}, accounted {want}"
    by = {r["layout"]: r["measured"] for r in rows}
    assert by["tp+sp"] * n == by["none"]  # sequence parallelism shards every activation
    if rank == 0:
        print(format_table(rows, config, 2, n), flush=True)


# ------------------------------------------------------------------------------ errors

def errors():
    tp_mesh, cp_mesh = Mesh(world, tp=n), Mesh(world, cp=n)
    model, cp = gpt(tp_mesh, "megatron"), gpt(cp_mesh, "ring")
    x = torch.zeros(2, 4 * n + 1, dtype=torch.long)
    if n > 1:
        # no longer than seq_len 16 (at 4 ranks 4n+1 = 17 fails the length check first)
        short = torch.zeros(2, 3 * n + 1, dtype=torch.long)
        raises(ValueError, f"sequence length {3 * n + 1} is not divisible by the tp size {n}",
               lambda: model(short))
        raises(ValueError, f"sequence length {4 * n + 1} is not divisible by the group size {n}",
               lambda: sequence_shard(x, world))
        bad = GPTConfig(vocab_size=vocab_size(), seq_len=8, d_model=24, n_heads=3, n_layers=1)
        raises(ValueError, f"ulysses: 3 heads per rank do not divide by cp={n}",
               lambda: parallelize(GPT(bad, 0), cp_mesh, PLANS["gpt"], sp="ulysses"))
    raises(ValueError, "exceeds the model's seq_len 16",
           lambda: cp(torch.zeros(2, 32 // n, dtype=torch.long)))
    raises(ValueError, "parallelize: sp='flash'",
           lambda: parallelize(GPT(CONFIG, SEED), cp_mesh, PLANS["gpt"], sp="flash"))
    raises(ValueError, "context parallel: unknown attention 'flash'",
           lambda: context_parallel_(GPT(CONFIG, SEED), world, "flash", CONFIG.n_heads, []))
    raises(ValueError, "expected token ids of shape (batch, time)",
           lambda: cp(torch.zeros(4, dtype=torch.long)))
    tp_mesh.free()
    cp_mesh.free()


check.run_cases(globals())
