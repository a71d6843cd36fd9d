"""A small GPT: the single-process reference that every parallel training scheme is checked against.

Submodule names (``tok_emb``, ``pos_emb``, ``blocks[i].ln1/attn/ln2/mlp``, ``attn.q/k/v/proj``,
``mlp.fc1/fc2``, ``ln_f``, ``head``) are part of the interface: tensor-parallel code swaps the
attention and MLP linears for per-rank slices by name.
"""
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # longest context the position embedding covers
    d_model: int
    n_heads: int
    n_layers: int
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            # bool is an int subclass, but GPTConfig(n_layers=True) is surely a mistake
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{field.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}; choose d_model as a multiple of n_heads")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections.

    Separate projections keep each head's weights a contiguous block of output rows, so a
    tensor-parallel rank can hold a subset of heads: replace q/k/v/proj with sliced linears and
    set ``n_heads`` to the number of heads kept. Forward derives the head size from the width
    q actually produces, never from the config.
    """

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, time, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]  # all heads this module holds, n_heads * head_dim

        def split_heads(t):  # (B, T, width) -> (B, heads, T, head_dim)
            return t.view(batch, time, self.n_heads, width // self.n_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v),
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class MLP(nn.Module):
    """fc1 -> GELU (exact, erf form) -> fc2; the hidden units split freely across ranks."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config.d_model, config.n_heads)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config.d_model, config.mlp_ratio * config.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def init_normal_(weight: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """weight ~ N(0, std) drawn from a CPU ``generator`` whatever weight's device, so that a
    model has the same parameters on every device (and on torch's default device)."""
    weight.copy_(torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
                 .normal_(0.0, std, generator=generator))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward`` gives logits, ``loss`` the mean cross-entropy.

    Parameters depend only on ``(config, seed)``: they are drawn from a local generator, and
    building the model leaves the global RNG as it was.
    """

    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        # nn.Linear and friends run a default init from the global RNG on construction; fork it
        # so that building a model never shifts random numbers drawn elsewhere.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_parameters(seed)

    @torch.no_grad()
    def _init_parameters(self, seed):
        generator = torch.Generator().manual_seed(seed)
        # named_modules has a fixed order, so each parameter gets the same draws every time
        for _, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                init_normal_(module.weight, 0.02, generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, idx):
        """Token ids (B, T) with T <= seq_len -> logits (B, T, vocab_size) in the model's dtype."""
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, time), got {tuple(idx.shape)}")
        time = idx.shape[1]
        if time > self.config.seq_len:
            raise ValueError(f"sequence length {time} exceeds the model's seq_len "
                             f"{self.config.seq_len}; use shorter inputs or a larger seq_len")
        positions = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, targets):
        """Mean next-token cross-entropy, computed in fp32 whatever the model's dtype."""
        return cross_entropy(self(idx), targets)

    def count_parameters(self):
        return sum(p.numel() for p in self.parameters())


def cross_entropy(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
