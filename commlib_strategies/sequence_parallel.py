"""Sequence and context parallelism: a group of ranks shares the work on each sequence.

Vocabulary. Activations are (batch, time, width). A tensor is *sequence-sharded* over a
group of n ranks when rank r holds the r-th of n equal contiguous chunks along time: the
tokens [r*T/n, (r+1)*T/n), its *shard*. ``sequence_shard`` cuts one out of a full batch.

Megatron sequence parallelism (``megatron_sp_gpt``, on the tp group) keeps tensor
parallelism's sharded weights and shards what TP leaves replicated (embeddings, LayerNorms,
residual adds) along time. Where TP copies a replicated input into a column-parallel linear,
SP all-gathers the shards along time (``gathered_linears``: q/k/v share one gather; only the
shard is kept for backward, which gathers it again); where TP all-reduces a row-parallel
output, SP reduce-scatters it along time. Same traffic as TP (an all-reduce is a
reduce-scatter plus an all-gather), but those regions hold 1/t of the activations.

Context parallelism (``context_parallel_gpt``, on the cp group): every rank holds the whole
model and a shard of every sequence. Everything but attention works token by token; attention
needs all earlier tokens:

    ulysses  all-to-all from sequence shards of all heads to all tokens of heads/cp heads,
             plain causal attention, and the reverse all-to-all (``ulysses_attention``)
    ring     K/V blocks travel around the ring while each rank attends its queries to the
             block in hand, merging blocks with an online softmax (``ring_attention``)

With a tp group as well (``context_parallel_gpt(..., tp=)``) the model is the tensor-parallel
GPT on sequence shards: each tp rank's heads/tp heads attend across the cp group as above.

Gradients. A parameter applied to a shard gets only that shard's part of its gradient. Such
parameters (under cp all of them; under Megatron SP those TP does not split: LayerNorms, the
position embedding, row-parallel biases) carry a hook that sums their gradient over the group
as autograd produces it, before it is accumulated: after ``loss.backward()`` every parameter
holds its full gradient, as in the unsharded model, so DataParallel or ZeRO over dp wrap
these models unchanged. The loss is the mean over every token of the batch: per-shard sums,
divided by the global token count, summed over the group.
"""
from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib_strategies.mappings import (all_to_all, gather_along, reduce_from_group,
                                         reduce_scatter_along)
from commlib_strategies.model import GPT, MLP
from commlib_strategies.tensor_parallel import (TensorParallelGPT, VocabParallelEmbedding,
                                                vocab_parallel_cross_entropy)

_KV_TAG, _GRAD_TAG = 1, 2  # ring messages: K/V blocks, and their dK/dV accumulators


def sequence_shard(t: torch.Tensor, group: commlib.Communicator) -> torch.Tensor:
    """This rank's shard of ``t`` (batch, time, ...) along time (a view)."""
    _check_time(t.shape[1], group)
    return t.chunk(group.size, 1)[group.rank]


def _check_time(time: int, group: commlib.Communicator, name: str = "group") -> None:
    if time % group.size:
        raise ValueError(f"sequence length {time} is not divisible by the {name} size "
                         f"{group.size}; use a sequence length that is a multiple of {group.size}")


def shard_positions(time: int, group: commlib.Communicator, config) -> torch.Tensor:
    """Positions of this rank's shard of sequences of ``time`` tokens, sequence-sharded over
    ``group``: what its position embedding looks up."""
    _check_time(time, group, "tp")
    return positions_of_shard(time // group.size, group, config)


def positions_of_shard(local_time: int, group, config) -> torch.Tensor:
    """Positions of this rank's ``local_time`` tokens (its shard), for the position
    embedding."""
    if local_time * group.size > config.seq_len:  # judged alike on every rank
        raise ValueError(f"sequence length {local_time * group.size} exceeds the model's seq_len "
                         f"{config.seq_len}; use shorter inputs or a larger seq_len")
    start = group.rank * local_time
    return torch.arange(start, start + local_time)


def sum_replicated_gradients(module: nn.Module, group: commlib.Communicator) -> None:
    """Hook every parameter of ``module`` that tensor parallelism does not split (held whole,
    used on a sequence shard under Megatron SP) to sum its gradient over ``group``. Hooks do
    not survive copying a parameter: whoever copies such modules calls
    ``rehook_gradient_sums`` on the copy."""
    for p in module.parameters():
        if getattr(p, "tp_split_dim", None) is None:
            _sum_gradient_over(p, group)


def sum_gradients(module: nn.Module, group: commlib.Communicator) -> None:
    """Hook every parameter of ``module`` (a context-parallel model's: all are used on
    sequence shards) to sum its gradient over ``group``. As for
    ``sum_replicated_gradients``, whoever copies such modules calls ``rehook_gradient_sums``
    on the copy."""
    for p in module.parameters():
        _sum_gradient_over(p, group)


def rehook_gradient_sums(module: nn.Module) -> None:
    """Hook every parameter of ``module``, a copy whose parameters were given the originals'
    attributes, as its original was: ``summed_over`` names the groups (the hooks themselves
    are not copied). A parameter is hooked once per group, however the model was built (under
    Megatron SP a MoE layer's experts take whole sequences and are not hooked at all)."""
    for p in module.parameters():
        for group in getattr(p, "summed_over", ()):
            _hook_sum(p, group)


def _sum_gradient_over(param: nn.Parameter, group: commlib.Communicator) -> None:
    """Make ``param``'s incoming gradient the sum over ``group`` (see the module docstring),
    and record it for copies (``rehook_gradient_sums``)."""
    if group.size > 1:
        param.summed_over = getattr(param, "summed_over", ()) + (group,)
        _hook_sum(param, group)


def _hook_sum(param: nn.Parameter, group: commlib.Communicator) -> None:
    def summed(grad):
        total = grad.contiguous().clone()
        group.all_reduce(total)
        return total
    param.register_hook(summed)


def context_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                   group: commlib.Communicator,
                                   tp: commlib.Communicator | None = None,
                                   vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch from this rank's logits of its shard
    (B, T/cp, V), or under ``tp`` its slice of the (padded) vocab of ``vocab_size``."""
    if tp is None:
        return sequence_sharded_cross_entropy(local_logits, targets, group)
    # the shard's mean, then the mean of the (equal) shards' means
    local = vocab_parallel_cross_entropy(local_logits, targets, tp, vocab_size)
    return reduce_from_group(local.reshape(1) / group.size, group)[0]


def sequence_sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                   group: commlib.Communicator) -> torch.Tensor:
    """Mean cross-entropy over every token, of logits (B, T/n, V) sequence-sharded over the
    group (fp32). The value is replicated; backward gives each rank its own tokens' part."""
    local = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return reduce_from_group(local.reshape(1) / (targets.numel() * group.size), group)[0]


# ------------------------------------------------------------------- attention cores
# Each takes q, k, v (batch, heads, time, head_dim) and returns the attention output.

def causal_attention(q, k, v):
    """Plain causal attention over whole sequences."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ulysses_attention(q, k, v, group: commlib.Communicator):
    """Causal attention of sequence shards: all-to-all to head shards (each rank gets all
    tokens of heads/n heads), plain causal attention, all-to-all back. Heads must divide."""
    def to_head_shards(t):
        return all_to_all(t, group, scatter_dim=1, gather_dim=2)
    y = causal_attention(to_head_shards(q), to_head_shards(k), to_head_shards(v))
    return all_to_all(y, group, scatter_dim=2, gather_dim=1)


def ring_attention(q, k, v, group: commlib.Communicator):
    """Causal attention of sequence shards, K/V passed around the ring of the group.

    Step s: rank r holds the K/V block of rank r-s (mod n) and sends it on to r+1 while it
    attends its queries to it (asynchronously: the next block arrives during the compute).
    Blocks of later tokens are wholly masked and skipped; the own block is masked causally.
    Blocks merge by online softmax: a running output and log-sum-exp per query. Backward
    passes K/V around again, with dK/dV accumulators travelling along; after n steps each
    accumulator has visited every rank and returns to its block's owner.
    """
    return _RingAttention.apply(q, k, v, group)


def _around_ring(block: torch.Tensor, group: commlib.Communicator, tag: int):
    """Yields (owner rank, block) for every rank's block, this rank's first. The next block
    is already travelling while the caller works on the one yielded."""
    n, rank = group.size, group.rank
    for step in range(n):
        pending = []
        if step < n - 1:
            incoming = torch.empty_like(block)
            pending = [group.send(block, (rank + 1) % n, tag, async_op=True),
                       group.recv(incoming, (rank - 1) % n, tag, async_op=True)]
        yield (rank - step) % n, block
        for work in pending:
            work.wait()
        if pending:
            block = incoming


def _scores(q, k, scale, diagonal: bool):
    """q k^T scaled; on the diagonal block (query and key shards alike) causally masked."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, scale = group.rank, q.shape[-1] ** -0.5
        dtype = torch.promote_types(q.dtype, torch.float32)  # the running sums in fp32 at least
        qw = q.to(dtype)
        # in place, so the output keeps q's layout: for q a view (batch, time, heads, dim)
        # of the projection, the caller's transpose back to (batch, time, width) is free
        out = torch.zeros_like(qw)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=dtype, device=q.device)
        for owner, kv in _around_ring(torch.stack([k, v]).to(dtype), group, _KV_TAG):
            if owner > rank:
                continue  # later tokens: masked
            scores = _scores(qw, kv[0], scale, owner == rank)
            merged = torch.logaddexp(lse, scores.logsumexp(-1, keepdim=True))
            out.mul_((lse - merged).exp()).add_((scores - merged).exp() @ kv[1])
            lse = merged  # finite from step 0 on: the own block's diagonal is never masked
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        n, rank, scale = group.size, group.rank, q.shape[-1] ** -0.5
        dtype = out.dtype
        qw, grad_out = q.to(dtype), grad_out.to(dtype)
        delta = (grad_out * out).sum(-1, keepdim=True)  # softmax backward's row term
        dq = torch.zeros_like(qw)
        arriving, sends = None, []  # dK/dV so far of the block in hand, from rank - 1
        for owner, kv in _around_ring(torch.stack([k, v]).to(dtype), group, _KV_TAG):
            dkv = torch.zeros_like(kv)
            if owner <= rank:
                p = (_scores(qw, kv[0], scale, owner == rank) - lse).exp()
                ds = p * (grad_out @ kv[1].transpose(-1, -2) - delta) * scale
                dq += ds @ kv[0]
                dkv[0] = ds.transpose(-1, -2) @ qw
                dkv[1] = p.transpose(-1, -2) @ grad_out
            if n == 1:
                break
            if arriving is not None:
                arriving[0].wait()
                dkv += arriving[1]
            sends.append(group.send(dkv, (rank + 1) % n, _GRAD_TAG, async_op=True))
            buffer = torch.empty_like(dkv)
            arriving = (group.recv(buffer, (rank - 1) % n, _GRAD_TAG, async_op=True), buffer)
        if arriving is not None:  # the last hop brings this rank's own block home
            arriving[0].wait()
            dkv = arriving[1]
        for work in sends:
            work.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# ------------------------------------------------------------------- Megatron SP pieces

def _start_gather(x, group):
    """Start the all-gather of sequence-sharded ``x`` along time; ``_finish`` waits."""
    src = x.movedim(1, 0).contiguous()  # collectives concatenate along the first dim
    out = src.new_empty((group.size * src.shape[0],) + src.shape[1:])
    return group.all_gather(out, src, async_op=True), out, src


def _start_reduce_scatter(x, group):
    src = x.movedim(1, 0).contiguous()
    out = src.new_empty((src.shape[0] // group.size,) + src.shape[1:])
    return group.reduce_scatter(out, src, async_op=True), out, src


def _finish(pending):
    work, out, _ = pending  # the source stays referenced until the collective is done
    work.wait()
    return out.movedim(0, 1)


def gathered_linears(x: torch.Tensor, group: commlib.Communicator, layers) -> tuple:
    """Each of ``layers`` (column-parallel slices: weight, bias or None) applied to ``x``
    all-gathered along time from its shards: one all-gather for all of them.

    Only the shard is saved for backward, which all-gathers it again (overlapping the input
    gradient's computation) and reduce-scatters the input gradient (the sum of every rank's
    partial one) along time, overlapping the weight gradients' computation."""
    params = [t for layer in layers for t in (layer.weight, layer.bias)]
    return _GatheredLinears.apply(x, group, *params)


class _GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        full = _finish(_start_gather(x, group))
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        gathering = _start_gather(x, ctx.group)
        grad_full = sum(g @ w for g, w in zip(grads, weights))
        scattering = _start_reduce_scatter(grad_full, ctx.group)
        full = _finish(gathering).reshape(-1, x.shape[-1])
        param_grads = []
        for g, has_bias in zip(grads, ctx.has_bias):
            g = g.reshape(-1, g.shape[-1])
            param_grads += [g.T @ full, g.sum(0) if has_bias else None]
        return (_finish(scattering), None, *param_grads)


def _scattered_row(layer, x):
    """A row-parallel slice whose partial output is reduce-scattered along time; its bias,
    held whole, is added to the shard."""
    y = reduce_scatter_along(F.linear(x, layer.weight), layer.group, 1)
    return y if layer.bias is None else y + layer.bias


# ------------------------------------------------------------------- the modules

class _Attention(nn.Module):
    """The reference attention's computation (same submodule names q, k, v, proj) on a
    shard. ``tp``: Megatron SP over that group (q/k/v column-parallel behind one gather,
    proj row-parallel reduce-scattered); else q/k/v/proj are whole. ``attend``: the core."""

    def __init__(self, attn: nn.Module, attend, tp: commlib.Communicator | None = None):
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.n_heads, self.attend, self.tp = attn.n_heads, attend, tp

    def forward(self, x):
        if self.tp is None:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = gathered_linears(x, self.tp, [self.q, self.k, self.v])
        batch, time, width = q.shape  # time: the whole sequence under tp, the shard under cp

        def split_heads(t):
            return t.view(batch, time, self.n_heads, width // self.n_heads).transpose(1, 2)

        y = self.attend(split_heads(q), split_heads(k), split_heads(v))
        y = y.transpose(1, 2).reshape(batch, time, width)
        return self.proj(y) if self.tp is None else _scattered_row(self.proj, y)


class _SequenceParallelMLP(nn.Module):
    """The reference MLP with fc1 column-parallel behind a gather and fc2 row-parallel,
    reduce-scattered: sequence-sharded in and out."""

    def __init__(self, mlp: nn.Module, tp: commlib.Communicator):
        super().__init__()
        self.fc1, self.fc2, self.tp = mlp.fc1, mlp.fc2, tp

    def forward(self, x):
        (hidden,) = gathered_linears(x, self.tp, [self.fc1])
        return _scattered_row(self.fc2, F.gelu(hidden))


class _SequenceScatteredEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding whose partial lookups are reduce-scattered along time."""

    def forward(self, idx):
        return reduce_scatter_along(self.partial_lookup(idx), self.group, 1)


class _GatheredHead(nn.Module):
    """A column-parallel layer (its parameters adopted, names kept) fed by a gather."""

    def __init__(self, column: nn.Module):
        super().__init__()
        self.weight, self.bias, self.group = column.weight, column.bias, column.group

    def forward(self, x):
        return gathered_linears(x, self.group, [self])[0]


class MegatronSequenceParallelGPT(TensorParallelGPT):
    """The tensor-parallel GPT with Megatron sequence parallelism over the same group.

    Takes whole sequences (B, T), the same on every rank of the group, T divisible by tp;
    ``forward``, ``loss`` and ``gathered_state`` work as for ``TensorParallelGPT``. Between
    the embedding and the LM head the residual stream is sequence-sharded: the vocab-parallel
    embedding's partial lookups are reduce-scattered along time (then each shard adds its own
    positions), and the final LayerNorm's shards are gathered into the vocab-parallel head.
    """

    def __init__(self, reference: GPT, group: commlib.Communicator):
        super().__init__(reference, group)
        # every module is called (not bypassed), so ZeRO-3's gathers before forward still fire
        self.tok_emb = _SequenceScatteredEmbedding.from_embedding(reference.tok_emb, group)
        self.head = _GatheredHead(self.head)
        for block in self.blocks:
            block.attn = _Attention(block.attn, causal_attention, tp=group)
            if isinstance(block.mlp, MLP):  # a MoE layer is made parallel by moe.py
                block.mlp = _SequenceParallelMLP(block.mlp, group)
        sum_replicated_gradients(self, group)

    def local_logits(self, idx):
        """Token ids (B, T) -> this rank's vocab slice of the logits of every token."""
        _check_ids(idx)
        positions = shard_positions(idx.shape[1], self.group, self.config)  # checks T first
        x = self.tok_emb(idx) + self.pos_emb(positions.to(idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ContextParallelGPT(nn.Module):
    """The reference GPT, whole on every rank of ``group`` (or, with ``tp``, the
    tensor-parallel GPT over that group), run on sequence shards.

    ``forward`` and ``loss`` take this rank's shard (B, T/cp) of the token ids (and targets),
    see ``sequence_shard``; ``forward`` returns the shard's logits (gathered over tp),
    ``loss`` the mean over every token of the batch (replicated). Parameter names match the
    reference's.
    """

    ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}

    def __init__(self, reference: GPT, group: commlib.Communicator, attention: str,
                 tp: commlib.Communicator | None = None):
        super().__init__()
        if attention not in self.ATTENTION:
            raise ValueError(f"context parallel: unknown attention {attention!r}; choose one of "
                             f"{', '.join(self.ATTENTION)}")
        config = reference.config
        heads = config.n_heads // (tp.size if tp is not None else 1)  # the heads a rank holds
        if attention == "ulysses" and heads % group.size:
            held = f"n_heads={heads}" if tp is None else \
                f"n_heads/tp={config.n_heads}/{tp.size}={heads}"
            raise ValueError(f"ulysses: {held} is not divisible by cp={group.size}; each rank "
                             f"attends whole heads, so choose cp dividing {heads} (or use ring "
                             "attention)")
        self.config, self.group, self.attention, self.tp = config, group, attention, tp
        # a tensor-parallel model is built fresh: its modules are this model's
        base = TensorParallelGPT(reference, tp) if tp is not None else copy.deepcopy(reference)
        self.tok_emb, self.pos_emb, self.blocks = base.tok_emb, base.pos_emb, base.blocks
        attend = partial(self.ATTENTION[attention], group=group)
        for block in self.blocks:
            block.attn = _Attention(block.attn, attend)  # q/k/v/proj: tp's slices, if any
        self.ln_f, self.head = base.ln_f, base.head
        sum_gradients(self, group)

    def local_logits(self, idx):
        """This rank's shard of token ids (B, T/cp) -> its logits (B, T/cp, V), or under tp
        this rank's slice of the (padded) vocab."""
        _check_ids(idx)
        x = self.tok_emb(idx) + self.pos_emb(positions_of_shard(idx.shape[1], self.group,
                                                             self.config).to(idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, idx):
        """This rank's shard of token ids (B, T/cp) -> its logits (B, T/cp, vocab_size)."""
        logits = self.local_logits(idx)
        if self.tp is None:
            return logits
        return gather_along(logits, self.tp, -1)[..., :self.config.vocab_size]

    def loss(self, idx, targets):
        return context_parallel_cross_entropy(self.local_logits(idx), targets, self.group,
                                              self.tp, self.config.vocab_size)


def _check_ids(idx):
    if idx.dim() != 2:
        raise ValueError(f"expected token ids of shape (batch, time), got {tuple(idx.shape)}")


def megatron_sp_gpt(reference: GPT, group: commlib.Communicator) -> MegatronSequenceParallelGPT:
    return MegatronSequenceParallelGPT(reference, group)


def context_parallel_gpt(reference: GPT, group: commlib.Communicator,
                         attention: str = "ring",
                         tp: commlib.Communicator | None = None) -> ContextParallelGPT:
    return ContextParallelGPT(reference, group, attention, tp)
