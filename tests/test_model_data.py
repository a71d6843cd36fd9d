"""The single-process reference GPT and the embedded addition dataset."""
import copy
import re
import time

import pytest
import torch
from torch import nn

from commlib_strategies.data import AdditionDataset, decode, encode, shard, vocab_size
from commlib_strategies.model import GPT, GPTConfig

TINY = GPTConfig(vocab_size=13, seq_len=16, d_model=16, n_heads=4, n_layers=2)


@pytest.fixture(autouse=True)
def one_thread():
    """The tests are tiny; one thread keeps them cheap on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_ids(shape, seed=0):
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_parameters(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# --- model ---

def test_same_seed_gives_identical_parameters_whatever_the_global_rng():
    torch.manual_seed(1)
    first = GPT(TINY, seed=7)
    torch.manual_seed(2)
    torch.rand(100)
    second = GPT(TINY, seed=7)
    assert_same_parameters(first, second)


def test_different_seeds_give_different_parameters():
    a, b = GPT(TINY, seed=0).state_dict(), GPT(TINY, seed=1).state_dict()
    assert not torch.equal(a["blocks.0.attn.q.weight"], b["blocks.0.attn.q.weight"])
    assert not torch.equal(a["tok_emb.weight"], b["tok_emb.weight"])


def test_building_a_model_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    GPT(TINY, seed=0)
    assert torch.equal(state, torch.get_rng_state())


def test_initialisation_scheme():
    model = GPT(TINY, seed=0)
    assert torch.count_nonzero(model.blocks[0].attn.q.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(TINY.d_model))
    assert model.head.bias is None
    assert 0.01 < model.tok_emb.weight.std().item() < 0.03


def test_parameter_count():
    d, v, t, layers, hidden = 16, 13, 16, 2, 64
    per_block = 4 * (d * d + d) + 2 * 2 * d + (d * hidden + hidden) + (hidden * d + d)
    expected = v * d + t * d + layers * per_block + 2 * d + d * v
    assert GPT(TINY, seed=0).count_parameters() == expected


def test_output_shape_and_loss():
    model = GPT(TINY, seed=0)
    idx = random_ids((3, 10))
    assert model(idx).shape == (3, 10, TINY.vocab_size)
    loss = model.loss(idx, random_ids((3, 10), seed=1))
    assert loss.shape == () and loss.dtype == torch.float32
    # an untrained model is close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(13.0)).item()) < 0.1


def test_attention_is_causal():
    model = GPT(TINY, seed=0)
    idx = random_ids((2, 12))
    changed = idx.clone()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("changes, message", [
    (dict(d_model=18), "GPTConfig.d_model=18 is not divisible by n_heads=4; "
                       "choose d_model as a multiple of n_heads"),
    (dict(n_layers=0), "GPTConfig.n_layers must be a positive int, got 0"),
    (dict(vocab_size=-3), "GPTConfig.vocab_size must be a positive int, got -3"),
    (dict(seq_len=8.0), "GPTConfig.seq_len must be a positive int, got 8.0"),
    (dict(mlp_ratio=True), "GPTConfig.mlp_ratio must be a positive int, got True"),
])
def test_config_validation(changes, message):
    fields = dict(vocab_size=13, seq_len=16, d_model=16, n_heads=4, n_layers=2) | changes
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(**fields)


def test_input_longer_than_seq_len_is_rejected():
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's seq_len 16"):
        GPT(TINY, seed=0)(random_ids((1, 17)))


def sliced_linear(linear, rows=slice(None), cols=slice(None), bias=True):
    weight = linear.weight[rows, cols]
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    with torch.no_grad():
        part.weight.copy_(weight)
        if bias:
            part.bias.copy_(linear.bias[rows])
    return part


def test_attention_splits_by_heads():
    attn = GPT(TINY, seed=0).blocks[0].attn
    x = torch.randn(2, 10, TINY.d_model, generator=torch.Generator().manual_seed(3))
    half = TINY.d_model // 2
    total = attn.proj.bias.detach().clone()  # the output bias belongs to no head: add it once
    for rows in (slice(0, half), slice(half, None)):
        part = copy.deepcopy(attn)
        part.n_heads = TINY.n_heads // 2
        part.q, part.k, part.v = (sliced_linear(getattr(attn, n), rows=rows) for n in "qkv")
        part.proj = sliced_linear(attn.proj, cols=rows, bias=False)
        total = total + part(x)
    torch.testing.assert_close(total, attn(x), rtol=1e-5, atol=1e-6)


def test_mlp_splits_by_hidden_units():
    mlp = GPT(TINY, seed=0).blocks[1].mlp
    x = torch.randn(2, 10, TINY.d_model, generator=torch.Generator().manual_seed(4))
    half = mlp.fc1.out_features // 2
    total = mlp.fc2.bias.detach().clone()
    for rows in (slice(0, half), slice(half, None)):
        part = copy.deepcopy(mlp)
        part.fc1 = sliced_linear(mlp.fc1, rows=rows)
        part.fc2 = sliced_linear(mlp.fc2, cols=rows, bias=False)
        total = total + part(x)
    torch.testing.assert_close(total, mlp(x), rtol=1e-5, atol=1e-6)


def test_bfloat16_forward_gives_finite_fp32_loss():
    model = GPT(TINY, seed=0).to(torch.bfloat16)
    idx = random_ids((2, 16))
    assert model(idx).dtype == torch.bfloat16
    loss = model.loss(idx, random_ids((2, 16), seed=1))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# --- data ---

def test_encode_decode_round_trip():
    text = "07+45=052\n317+85=402\n"
    assert decode(encode(text)) == text
    assert max(encode(text)) < vocab_size()
    with pytest.raises(ValueError, match=r"characters \['a'\] are not in the vocabulary"):
        encode("1+a")


def test_stream_holds_correct_zero_padded_additions():
    data = AdditionDataset(seed=0, max_digits=3, num_chars=2000)
    text = decode(data.tokens)
    assert len(text) >= 2000 and text.endswith("\n")
    for line in text.splitlines():
        left, total = line.split("=")
        a, b = left.split("+")
        assert (len(a), len(b), len(total)) == (3, 3, 4)
        assert int(a) + int(b) == int(total)


def test_dataset_is_determined_by_seed():
    a, b, c = (AdditionDataset(seed=s, num_chars=5000) for s in (0, 0, 1))
    assert (a.tokens == b.tokens).all()
    assert len(a) != len(c) or (a.tokens != c.tokens).any()


def test_batch_is_a_function_of_step_only():
    data = AdditionDataset(seed=0, num_chars=5000)
    fresh = AdditionDataset(seed=0, num_chars=5000)
    data.batch(3, 4, 8)  # call history must not matter
    for x, y in zip(data.batch(5, 4, 8), fresh.batch(5, 4, 8)):
        assert torch.equal(x, y)
    assert not torch.equal(data.batch(5, 4, 8)[0], data.batch(6, 4, 8)[0])


def test_targets_are_inputs_shifted_by_one():
    inputs, targets = AdditionDataset(seed=0, num_chars=5000).batch(0, 4, 8)
    assert inputs.shape == targets.shape == (4, 8)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_shard_takes_equal_contiguous_rows():
    batch = torch.arange(16).view(8, 2)
    assert torch.equal(shard(batch, 1, 4), batch[2:4])
    assert torch.equal(torch.cat([shard(batch, r, 4) for r in range(4)]), batch)
    message = "batch size 6 does not divide by dp=4; use a multiple of 4"
    with pytest.raises(ValueError, match=message):
        shard(torch.zeros(6, 3), 0, 4)
    with pytest.raises(ValueError, match="shard index 4 is out of range for 4 shards"):
        shard(batch, 4, 4)


# --- training ---

def test_tiny_gpt_learns_the_dataset():
    config = GPTConfig(vocab_size=vocab_size(), seq_len=32, d_model=32, n_heads=4, n_layers=2)
    model = GPT(config, seed=0)
    data = AdditionDataset(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    losses = []
    for step in range(100):
        loss = model.loss(*data.batch(step, 16, config.seq_len))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    final = sum(losses[-5:]) / 5  # average a few steps: single-batch losses are noisy
    print(f"\n100 steps in {elapsed:.2f} s; loss {losses[0]:.3f} -> {final:.3f}")
    assert final < 0.7 * losses[0]
