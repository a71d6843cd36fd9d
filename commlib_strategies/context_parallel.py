"""Context parallelism (on the cp group): every rank holds the whole model and a shard of
every sequence (sequence_parallel.py's vocabulary). Everything but attention works token by
token; attention needs all earlier tokens:

    ulysses  all-to-all from sequence shards of all heads to all tokens of heads/cp heads,
             causal attention, and the reverse all-to-all (``ulysses_attention``)
    ring     K/V blocks travel around the ring while each rank attends its queries to the
             block in hand, merging blocks with an online softmax (``ring_attention``)

``context_parallel_`` sets the attention modules' core (``module.attend``: the project's GPT
calls it, transformers' models through their attention interface, families.py), gives
each rank's tokens their global positions and makes the loss the mean over every token of
the batch (model.LanguageModel's ``cp_group``), and sums every parameter's gradient over
the group as autograd produces it, so DataParallel or ZeRO over dp wrap the model
unchanged. Under tensor parallelism each tp rank's heads attend across the cp group. Both
score as the model does (attention.py: its scale, soft-capped logits, sliding windows,
learned sinks).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

import commlib
from commlib_strategies.attention import PLAIN, Scoring, causal_attention, logits, sees
from commlib_strategies.mappings import all_to_all
from commlib_strategies.sequence_parallel import sum_gradients

_KV_TAG, _GRAD_TAG = 1, 2  # ring messages: K/V blocks, and their dK/dV accumulators


def ulysses_attention(q, k, v, group: commlib.Communicator, scoring: Scoring = PLAIN,
                      sinks=None):
    """Causal attention of sequence shards: all-to-all to head shards (each rank gets all
    tokens of heads/n heads), causal attention as ``scoring`` says (attention.py; with
    ``sinks``, one per head, this rank's heads' share), all-to-all back. Heads must divide."""
    def to_head_shards(t):
        return all_to_all(t, group, scatter_dim=1, gather_dim=2)
    if sinks is not None:
        sinks = sinks.chunk(group.size)[group.rank]
    y = causal_attention(to_head_shards(q), to_head_shards(k), to_head_shards(v), scoring,
                         sinks)
    return all_to_all(y, group, scatter_dim=2, gather_dim=1)


def ring_attention(q, k, v, group: commlib.Communicator, scoring: Scoring = PLAIN,
                   sinks=None):
    """Causal attention of sequence shards, K/V passed around the ring of the group; logits
    as ``scoring`` says, ``sinks`` (one per head) or None (attention.py).

    Step s: rank r holds the K/V block of rank r-s (mod n) and sends it on to r+1 while it
    attends its queries to it (asynchronously: the next block arrives during the compute).
    Blocks of later tokens, or wholly past a sliding window, are skipped; the own block is
    masked causally.
    Blocks merge by online softmax: a running output and log-sum-exp per query. Backward
    passes K/V around again, with dK/dV accumulators travelling along; after n steps each
    accumulator has visited every rank and returns to its block's owner.
    """
    return _RingAttention.apply(q, k, v, sinks, group, scoring)


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scoring):
        rank, time = group.rank, q.shape[-2]
        dtype = torch.promote_types(q.dtype, torch.float32)  # the running sums in fp32 at least
        qw = q.to(dtype)
        # in place, so the output keeps q's layout: for q a view (batch, time, heads, dim)
        # of the projection, the caller's transpose back to (batch, time, width) is free
        out = torch.zeros_like(qw)
        # a sink is a key of value zero every query sees first: the running log-sum-exp
        # starts at it and the output at zero
        lse = (torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=dtype, device=q.device)
               if sinks is None else _per_head(sinks.to(dtype), q).clone())
        for owner, kv in _around_ring(torch.stack([k, v]).to(dtype), group, _KV_TAG):
            offset = (rank - owner) * time
            if not sees(time, time, offset, scoring.window):
                continue  # later tokens, or all past the window
            scores, _ = logits(qw, kv[0], scoring, offset)
            merged = torch.logaddexp(lse, scores.logsumexp(-1, keepdim=True))
            out.mul_((lse - merged).exp()).add_((scores - merged).exp() @ kv[1])
            lse = merged  # finite from step 0 on: every query sees itself
        ctx.group, ctx.scoring = group, scoring
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        group, scoring = ctx.group, ctx.scoring
        n, rank, time = group.size, group.rank, q.shape[-2]
        dtype = out.dtype
        qw, grad_out = q.to(dtype), grad_out.to(dtype)
        delta = (grad_out * out).sum(-1, keepdim=True)  # softmax backward's row term
        dq = torch.zeros_like(qw)
        arriving, sends = None, []  # dK/dV so far of the block in hand, from rank - 1
        for owner, kv in _around_ring(torch.stack([k, v]).to(dtype), group, _KV_TAG):
            dkv = torch.zeros_like(kv)
            offset = (rank - owner) * time
            if sees(time, time, offset, scoring.window):
                scores, slope = logits(qw, kv[0], scoring, offset)
                p = (scores - lse).exp()
                ds = p * (grad_out @ kv[1].transpose(-1, -2) - delta) * slope
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
        dsinks = None
        if sinks is not None:  # a sink's value is zero: its logit's gradient is -p * delta
            mass = (_per_head(sinks.to(dtype), q) - lse).exp() * delta
            dsinks = -mass.movedim(-3, 0).reshape(sinks.numel(), -1).sum(1).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                dsinks, None, None)


def _per_head(sinks, q):
    """(heads,) sink logits as q's (..., heads, time, 1)."""
    return sinks.view(-1, 1, 1).expand(q.shape[:-1] + (1,))


ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}


def context_parallel_(model: nn.Module, group: commlib.Communicator, attention: str,
                      heads: int, modules: list) -> None:
    """Make ``model`` (a model.LanguageModel) context-parallel over ``group`` in place: its
    attention ``modules`` attend with ``attention``, "ulysses" or "ring"; ``heads``: the
    query heads each rank's attention holds (Ulysses splits them over the group)."""
    if attention not in ATTENTION:
        raise ValueError(f"context parallel: unknown attention {attention!r}; choose one of "
                         f"{', '.join(ATTENTION)}")
    if attention == "ulysses" and heads % group.size:
        raise ValueError(f"ulysses: {heads} heads per rank do not divide by cp={group.size}; "
                         f"each rank attends whole heads, so choose cp dividing {heads} (or "
                         "ring attention)")
    attend = partial(ATTENTION[attention], group=group)
    for module in modules:
        module.attend = attend
    model.shard_sequences(group)
    sum_gradients(model, group)
