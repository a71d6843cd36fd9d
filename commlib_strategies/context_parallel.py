"""Context parallelism for transformers' models: each rank of the cp group runs the whole
model on its shard of every sequence, and only attention looks across shards.

The model's own attention entry point is replaced through transformers' attention
interface (``AttentionInterface``): every attention module of the model calls
``_attend``, which runs Ulysses or ring attention (sequence_parallel.py) over the group the
module carries (``module.cp_group``), so no group lives in a global. Each rank's tokens get
their global positions (``positions``), the loss is the mean over every token of the batch
(``sequence_sharded_cross_entropy``), and every parameter's gradient is summed over the
group as autograd produces it, so DataParallel or ZeRO over dp wrap the model unchanged.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

import commlib
from commlib_strategies.sequence_parallel import (_check_time, ring_attention, sum_gradients,
                                                  ulysses_attention)

ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}
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
