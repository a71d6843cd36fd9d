"""Context parallelism (on the cp group): every rank holds the whole model and a shard of
every sequence (sequence_parallel.py's vocabulary). Everything but attention works token by
token; attention needs all earlier tokens:

    ulysses  all-to-all from sequence shards of all heads to all tokens of heads/cp heads,
             plain causal attention, and the reverse all-to-all (``ulysses_attention``)
    ring     K/V blocks travel around the ring while each rank attends its queries to the
             block in hand, merging blocks with an online softmax (``ring_attention``)

The project's GPT: ``context_parallel_gpt``; with a tp group as well
(``context_parallel_gpt(..., tp=)``) the model is the tensor-parallel GPT on sequence
shards: each tp rank's heads/tp heads attend across the cp group as above.

transformers' models (``context_parallel_``): the model's own attention entry point is
replaced through transformers' attention interface (``AttentionInterface``): every attention
module of the model calls ``_attend``, which runs Ulysses or ring attention over the group
the module carries (``module.cp_group``), so no group lives in a global. Each rank's tokens
get their global positions (``positions``), the loss is the mean over every token of the
batch (``sequence_sharded_cross_entropy``), and every parameter's gradient is summed over
the group as autograd produces it, so DataParallel or ZeRO over dp wrap the model unchanged.
"""
from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

import commlib
from commlib_strategies.mappings import all_to_all, gather_along, reduce_from_group
from commlib_strategies.megatron_sp import _Attention
from commlib_strategies.model import GPT
from commlib_strategies.sequence_parallel import (_check_ids, _check_time, causal_attention,
                                                  positions_of_shard,
                                                  sequence_sharded_cross_entropy, sum_gradients)
from commlib_strategies.tensor_parallel import TensorParallelGPT, vocab_parallel_cross_entropy

_KV_TAG, _GRAD_TAG = 1, 2  # ring messages: K/V blocks, and their dK/dV accumulators


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


ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}


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


# ------------------------------------------------------------------- the project's GPT

class ContextParallelGPT(nn.Module):
    """The reference GPT, whole on every rank of ``group`` (or, with ``tp``, the
    tensor-parallel GPT over that group), run on sequence shards.

    ``forward`` and ``loss`` take this rank's shard (B, T/cp) of the token ids (and targets),
    see ``sequence_shard``; ``forward`` returns the shard's logits (gathered over tp),
    ``loss`` the mean over every token of the batch (replicated). Parameter names match the
    reference's.
    """

    def __init__(self, reference: GPT, group: commlib.Communicator, attention: str,
                 tp: commlib.Communicator | None = None):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"context parallel: unknown attention {attention!r}; choose one of "
                             f"{', '.join(ATTENTION)}")
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
        attend = partial(ATTENTION[attention], group=group)
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


def context_parallel_gpt(reference: GPT, group: commlib.Communicator,
                         attention: str = "ring",
                         tp: commlib.Communicator | None = None) -> ContextParallelGPT:
    return ContextParallelGPT(reference, group, attention, tp)


# ------------------------------------------------------------------- transformers' models

_NAME = "commlib_context_parallel"


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q, k, v (batch, heads, time/cp, head_dim) of this
    rank's shard -> (batch, time/cp, heads, head_dim), causal over the whole sequence (the
    model's own mask, built for the shard alone, is not used)."""
    if dropout:
        raise ValueError("context parallel attention has no dropout; build the model with "
                         "attention dropout 0")
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"context parallel attention scales by 1/sqrt(head_dim), the model "
                         f"asks for {scaling}")
    groups = query.shape[1] // key.shape[1]  # grouped queries: each k/v head serves several
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = module.cp_attention(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(_NAME, _attend)
    AttentionMaskInterface.register(_NAME, lambda *args, **kwargs: None)  # attention masks


def context_parallel_(model: nn.Module, group: commlib.Communicator, attention: str,
                      heads: int) -> None:
    """Make a transformers causal LM (families.CausalLM) context-parallel over ``group`` in
    place, with ``attention`` "ulysses" or "ring"; ``heads``: the query heads each rank's
    attention holds (Ulysses splits them over the group)."""
    if attention not in ATTENTION:
        raise ValueError(f"context parallel: unknown attention {attention!r}; choose one of "
                         f"{', '.join(ATTENTION)}")
    if attention == "ulysses" and heads % group.size:
        raise ValueError(f"ulysses: {heads} heads per rank do not divide by cp={group.size}; "
                         f"choose cp dividing {heads} (or ring attention)")
    _register()
    attend = partial(ATTENTION[attention], group=group)
    found = 0
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "head_dim"):  # an attention module
            module.cp_group, module.cp_attention = group, attend
            found += 1
    if not found:
        raise ValueError(f"context parallel: no attention module found in "
                         f"{type(model).__name__}")
    model.hf.config._attn_implementation = _NAME
    model.cp_group = group
    sum_gradients(model, group)


def positions(local_time: int, group: commlib.Communicator, device) -> torch.Tensor:
    """The global positions (1, local_time) of this rank's shard of each sequence."""
    _check_time(local_time * group.size, group, "cp")
    start = group.rank * local_time
    return torch.arange(start, start + local_time, device=device).unsqueeze(0)
