"""The language models the strategies train: what every one of them is (``LanguageModel``),
and a small GPT, the project's own, as one of them.

``LanguageModel`` fixes how a model is called whatever the parallelisms applied to it
(parallelize.py): ``run(input_ids=...)`` or ``run(inputs_embeds=...)`` gives this rank's
logits, ``model(ids)`` the whole logits, ``model.loss(ids, targets)`` (``model(ids,
targets)``) the mean next-token cross-entropy of the whole batch plus the mixture-of-experts
layers' weighted aux losses. Two attributes say what
the parallelisms did to the model's ends:

    cp_group     context parallelism: ids are this rank's sequence shards, at their global
                 positions; the loss is the mean over every shard's tokens
    vocab_group  tensor parallelism over the vocab: the LM head is column-parallel, logits
                 are this rank's slice of the (padded) vocab, and the loss never gathers
                 them (``vocab_parallel_cross_entropy``); ``vocab_size``: the real vocab

The GPT's submodule names (``tok_emb``, ``pos_emb``, ``blocks[i].ln1/attn/ln2/mlp``,
``attn.q/k/v/proj``, ``mlp.fc1/fc2``, ``ln_f``, ``head``) are what its plan (plans.py) names.
"""
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from commlib_strategies.attention import causal_attention
from commlib_strategies.mappings import gather_along, reduce_from_group
from commlib_strategies.sequence_parallel import positions, sequence_sharded_cross_entropy
from commlib_strategies.tensor_parallel import vocab_parallel_cross_entropy


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
    q actually produces, never from the config. ``attend`` is the attention core, which
    context parallelism replaces.
    """

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attend = causal_attention

    def forward(self, x):
        batch, time, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]  # all heads this module holds, n_heads * head_dim

        def split_heads(t):  # (B, T, width) -> (B, heads, T, head_dim)
            return t.view(batch, time, self.n_heads, width // self.n_heads).transpose(1, 2)

        y = self.attend(split_heads(q), split_heads(k), split_heads(v))
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


class LanguageModel(nn.Module):
    """A causal language model as the strategies drive it (see the module docstring).
    Subclasses give ``run`` and ``vocab_size``."""
    cp_group = None
    vocab_group = None
    aux_weight = 0.0  # the weight of the mixture-of-experts layers' aux losses in ``loss``

    def run(self, **inputs) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), whole over the vocab (under context
        parallelism of this rank's shard of each sequence); with ``targets``, the loss."""
        logits = self.run(input_ids=ids)
        if targets is not None:
            loss = self.loss_of(logits, targets)
            aux = self.aux_loss()
            return loss if aux is None else loss + aux
        if self.vocab_group is None:
            return logits
        return gather_along(logits, self.vocab_group, -1)[..., :self.vocab_size]

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy over the batch, plus the weighted aux losses.
        Through the module's call, so hooks on the model (ZeRO 3's root unit) run."""
        return self(ids, targets)

    def loss_of(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over every token of the batch (of every shard) of this
        rank's logits, in fp32."""
        cp, vocab = self.cp_group, self.vocab_group
        if vocab is None:
            return cross_entropy(logits, targets) if cp is None else \
                sequence_sharded_cross_entropy(logits, targets, cp)
        local = vocab_parallel_cross_entropy(logits, targets, vocab, self.vocab_size)
        if cp is None:
            return local
        return reduce_from_group(local.reshape(1) / cp.size, cp)[0]  # the shards' mean

    def aux_loss(self):
        """``aux_weight`` times the sum of the aux losses of the model's mixture-of-experts
        layers (those it holds: a pipeline piece's) in the last forward; None without."""
        layers = [m.aux_loss for m in self.modules()
                  if m is not self and torch.is_tensor(getattr(m, "aux_loss", None))]
        return self.aux_weight * sum(layers) if layers else None

    def architecture(self):
        """The config whose attributes a plan names (``Plan.heads``)."""
        return self.config

    def shard_sequences(self, group) -> None:
        """Context parallelism over ``group``: ids are sequence shards from now on."""
        self.cp_group = group

    def count_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class GPT(LanguageModel):
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

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def run(self, input_ids=None, inputs_embeds=None):
        """Token ids (B, T), or hidden states (B, T, d_model) in place of the token
        embeddings (a pipeline piece past the first), T <= seq_len -> logits in the model's
        dtype (this rank's part: see LanguageModel)."""
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, time), got "
                             f"{tuple(input_ids.shape)}")
        x = self.tok_emb(input_ids) if inputs_embeds is None else inputs_embeds
        time = x.shape[1] * (1 if self.cp_group is None else self.cp_group.size)
        if time > self.config.seq_len:  # judged alike on every rank
            raise ValueError(f"sequence length {time} exceeds the model's seq_len "
                             f"{self.config.seq_len}; use shorter inputs or a larger seq_len")
        where = torch.arange(x.shape[1], device=x.device) if self.cp_group is None else \
            positions(x.shape[1], self.cp_group, x.device)[0]
        x = x + self.pos_emb(where)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def cross_entropy(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
