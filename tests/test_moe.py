"""commlib_strategies/moe.py: routing, capacity, the aux loss and the MoE GPT in one process
(hand-built cases), and the expert-parallel layer and GPT under mpiexec against the
one-process model (tests/mpi/strategies_moe.py: EP 2, EP 4, EP x DP, EP x TP (with
Megatron SP), EP x CP, TP x CP, PP x EP, PP x TP (with Megatron SP) and PP x CP, with
ZeRO 0-3, in one 4-rank launch)."""
import copy
import math

import pytest

from mpirun import run_checked

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from commlib_strategies.data import AdditionDataset, vocab_size  # noqa: E402
from commlib_strategies.model import GPT, MLP, Block, GPTConfig, cross_entropy  # noqa: E402
from commlib_strategies.expert_parallel import expert_parameters  # noqa: E402
from commlib_strategies.moe import MoE, moe_gpt  # noqa: E402

CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2)


def layer(experts, topk, capacity_factor, d_model=4, group_rows=None, seed=0):
    torch.manual_seed(seed)
    return MoE(d_model, 6, experts, topk, capacity_factor, group_rows).double()


def set_router(moe, weight):
    """Router logits = x @ weight.T: with one-hot tokens, each token's logits are a column."""
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor(weight, dtype=torch.float64))


def one_hot_tokens(features, d_model=4):
    """(1, len(features), d_model) tokens; token t is the unit vector of features[t]."""
    return torch.eye(d_model, dtype=torch.float64)[list(features)].unsqueeze(0)


def expert_out(moe, e, token):
    return moe.experts[str(e)](token)


def test_top1_sends_each_token_to_its_best_expert_scaled_by_its_probability():
    moe = layer(experts=3, topk=1, capacity_factor=10.0)  # no token dropped
    x = torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    best = probs.argmax(-1)
    assert len(set(best.flatten().tolist())) > 1  # the case routes to several experts
    for b in range(2):
        for t in range(5):
            e = int(best[b, t])
            want = probs[b, t, e] * expert_out(moe, e, x[b, t])
            torch.testing.assert_close(y[b, t], want, rtol=1e-12, atol=1e-12)
    assert moe.dropped == 0


def test_top2_mixes_the_two_best_experts_with_renormalised_gates():
    moe = layer(experts=4, topk=2, capacity_factor=10.0)
    x = torch.randn(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    top_p, top_e = probs.topk(2, -1)
    for b in range(3):
        for t in range(4):
            (p1, p2), (e1, e2) = top_p[b, t], top_e[b, t].tolist()
            mixed = p1 * expert_out(moe, e1, x[b, t]) + p2 * expert_out(moe, e2, x[b, t])
            want = mixed / (p1 + p2)
            torch.testing.assert_close(y[b, t], want, rtol=1e-12, atol=1e-12)


def test_capacity_keeps_the_first_tokens_and_drops_the_rest_to_zero():
    # 6 tokens all preferring expert 0; capacity ceil(1.0 * 1 * 6 / 2) = 3
    moe = layer(experts=2, topk=1, capacity_factor=1.0)
    set_router(moe, [[2.0, 0, 0, 0], [0.0, 0, 0, 0]])
    x = one_hot_tokens([0] * 6)
    assert moe.capacity(6) == 3
    y = moe(x)
    gate = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)[0]
    for t in range(3):
        torch.testing.assert_close(y[0, t], gate * expert_out(moe, 0, x[0, t]))
    assert torch.equal(y[0, 3:], torch.zeros(3, 4, dtype=torch.float64))
    assert moe.dropped == 3
    # dropped tokens contribute nothing: no gradient reaches any expert or the router
    y[0, 3:].sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is None or not p.grad.any(), name


def test_first_choices_take_capacity_before_any_second_choice():
    # tokens 0, 1 prefer expert 0 then 1; tokens 2, 3 prefer 1 then 0; capacity
    # ceil(0.75 * 2 * 4 / 3) = 2. First choices fill experts 0 and 1, so every second choice
    # is dropped (in token order instead, token 0 and 1 would take both and 2, 3 nothing).
    moe = layer(experts=3, topk=2, capacity_factor=0.75)
    set_router(moe, [[2.0, 1, 0, 0], [1.0, 2, 0, 0], [0.0, 0, 0, 0]])
    x = one_hot_tokens([0, 0, 1, 1])
    assert moe.capacity(4) == 2
    y = moe(x)
    assert moe.dropped == 4
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), 0)
    gate = p[0] / (p[0] + p[1])  # renormalised over the two choices, not after dropping
    for t, first in enumerate([0, 0, 1, 1]):
        torch.testing.assert_close(y[0, t], gate * expert_out(moe, first, x[0, t]))


def test_a_token_whose_choices_are_all_dropped_passes_through_the_block_residual():
    config = GPTConfig(vocab_size=8, seq_len=6, d_model=4, n_heads=1, n_layers=1)
    block = Block(config).double()
    block.mlp = moe = layer(experts=2, topk=1, capacity_factor=0.5)  # capacity ceil(1.5) = 2
    x = torch.randn(1, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    moe.router = nn.Linear(4, 2).double()  # every token to expert 0, whatever its features
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.bias.copy_(torch.tensor([1.0, 0.0]))
    h = x + block.attn(block.ln1(x))
    mixed = moe(block.ln2(h))
    assert moe.dropped == 4 and mixed[0, :2].abs().min() > 0
    out = block(x)
    torch.testing.assert_close(out[0, 2:], h[0, 2:], rtol=0, atol=0)
    torch.testing.assert_close(out[0, :2], (h + mixed)[0, :2])


def test_aux_loss_on_a_hand_checked_case():
    # E = 2, top-1. Logits ln 3 vs 0: three tokens (0.75, 0.25) choose expert 0, one token
    # (0.25, 0.75) chooses expert 1. f = (3/4, 1/4); P = (0.625, 0.375);
    # aux = 2 * (0.75 * 0.625 + 0.25 * 0.375) = 1.125.
    moe = layer(experts=2, topk=1, capacity_factor=10.0)
    ln3 = math.log(3)
    set_router(moe, [[ln3, 0, 0, 0], [0, ln3, 0, 0]])
    moe(one_hot_tokens([0, 0, 0, 1]))
    torch.testing.assert_close(moe.aux_loss, torch.tensor(1.125, dtype=torch.float64))
    # balanced routing gives exactly 1; two routing groups average their losses
    moe(one_hot_tokens([0, 1, 0, 1]))
    torch.testing.assert_close(moe.aux_loss, torch.tensor(1.0, dtype=torch.float64))
    moe.group_rows = 1
    moe(torch.cat([one_hot_tokens([0, 0, 0, 1]), one_hot_tokens([0, 1, 0, 1])]))
    torch.testing.assert_close(moe.aux_loss, torch.tensor(1.0625, dtype=torch.float64))
    # f counts choices, not gradients: d aux / d P_e = E * f_e, so the router's gradient is
    # that of E * sum_e f_e * P_e with f held fixed
    moe.group_rows = None
    x = one_hot_tokens([0, 0, 0, 1])
    moe.router.weight.grad = None
    moe(x)
    moe.aux_loss.backward()
    got = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    probs = torch.softmax(moe.router(x[0]), -1)
    (2 * (torch.tensor([0.75, 0.25], dtype=torch.float64) * probs.mean(0)).sum()).backward()
    torch.testing.assert_close(got, moe.router.weight.grad)


def test_routing_groups_route_like_separate_calls():
    """group_rows = 2 on 6 rows is three independent layers' worth of routing: what an
    expert-parallel rank computes on its own rows."""
    moe = layer(experts=4, topk=2, capacity_factor=0.8, d_model=8, group_rows=2)
    x = torch.randn(6, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y, aux, dropped = moe(x), moe.aux_loss, moe.dropped
    assert dropped > 0
    moe.group_rows = None
    parts = [(moe(x[i:i + 2]), moe.aux_loss, moe.dropped) for i in range(0, 6, 2)]
    torch.testing.assert_close(y, torch.cat([p[0] for p in parts]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux, sum(p[1] for p in parts) / 3)
    assert dropped == sum(p[2] for p in parts)
    assert not torch.allclose(moe(x), y)  # one group of all six rows competes differently


def test_moe_gpt_is_the_reference_with_moe_mlps_drawn_from_a_seed():
    reference = GPT(CONFIG, seed=1)
    rng = torch.get_rng_state()
    model = moe_gpt(reference, experts=4, topk=2, seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # building draws nothing
    same = moe_gpt(GPT(CONFIG, seed=1), experts=4, topk=2, seed=7)
    other = moe_gpt(GPT(CONFIG, seed=1), experts=4, topk=2, seed=8)
    dense = dict(reference.named_parameters())
    experts = expert_parameters(model)
    for (name, p), q, r in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        if ".mlp." in name:
            assert name.split(".mlp.")[1].startswith(("router.", "experts."))
            assert (id(p) in experts) == getattr(p, "expert_parallel", False) == ("experts" in name)
            if name.endswith("weight"):
                assert not torch.equal(p, r), name
        else:
            assert torch.equal(p, dense[name]), name
    assert type(model) is GPT and model.aux_weight == 0.01  # a plain GPT, its weight set
    assert all(isinstance(b.mlp, MoE) and isinstance(b.mlp.experts["3"], MLP)
               for b in model.blocks)
    assert isinstance(reference.blocks[0].mlp, MLP)  # the reference is left as it was
    assert reference.aux_weight == 0.0
    assert model.aux_loss() is None  # no forward yet
    x, y = AdditionDataset(0).batch(0, 4, CONFIG.seq_len)
    loss = model.loss(x, y)
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    torch.testing.assert_close(model.aux_loss(), 0.01 * aux)
    torch.testing.assert_close(loss, cross_entropy(model(x), y) + 0.01 * aux)
    reference.loss(x, y)
    assert reference.aux_loss() is None  # no MoE layers
    assert copy.deepcopy(model).blocks[0].mlp.aux_loss is None  # the last graph is not copied


def test_errors():
    with pytest.raises(ValueError, match="topk=3 exceeds experts=2"):
        MoE(4, 4, 2, 3)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        MoE(4, 4, 2, 1, 0.0)
    with pytest.raises(ValueError, match="experts must be a positive int"):
        MoE(4, 4, 0, 1)
    with pytest.raises(ValueError, match="group_rows must be a positive int, got True"):
        MoE(4, 4, 2, 1, group_rows=True)
    moe = MoE(4, 4, 2, 1, group_rows=2)
    with pytest.raises(ValueError, match="a batch of 3 rows does not split into routing groups"):
        moe(torch.zeros(3, 5, 4))
    with pytest.raises(ValueError, match=r"expected input \(rows, ..., 4\), got \(3, 5\)"):
        moe(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="moe_gpt: aux_weight must be non-negative"):
        moe_gpt(GPT(CONFIG, seed=1), experts=2, aux_weight=-1.0)


def test_expert_parallel_matches_one_process():
    run_checked(4, "tests/mpi/strategies_moe.py")
