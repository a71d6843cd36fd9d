"""Megatron sequence parallelism (``megatron_sp_gpt``, on the tp group): tensor parallelism's
sharded weights, and what TP leaves replicated (embeddings, LayerNorms, residual adds)
sharded along time (sequence_parallel.py's vocabulary). Where TP copies a replicated input
into a column-parallel linear, SP all-gathers the shards along time (``gathered_linears``:
q/k/v share one gather; only the shard is kept for backward, which gathers it again); where
TP all-reduces a row-parallel output, SP reduce-scatters it along time. Same traffic as TP
(an all-reduce is a reduce-scatter plus an all-gather), but those regions hold 1/t of the
activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib_strategies.mappings import reduce_scatter_along
from commlib_strategies.model import GPT, MLP
from commlib_strategies.sequence_parallel import (_check_ids, causal_attention, shard_positions,
                                                  sum_replicated_gradients)
from commlib_strategies.tensor_parallel import TensorParallelGPT, VocabParallelEmbedding


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


def megatron_sp_gpt(reference: GPT, group: commlib.Communicator) -> MegatronSequenceParallelGPT:
    return MegatronSequenceParallelGPT(reference, group)
