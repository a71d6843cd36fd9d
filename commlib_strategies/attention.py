"""Causal attention as real models score it, for whole sequences and for the blocks that
context parallelism (context_parallel.py) attends one at a time.

Vocabulary. q, k, v are (batch, heads, time, head_dim). A query's *logits* are its scores
against the keys before the softmax: q.k scaled (``Scoring.scale``, 1/sqrt(head_dim) by
default), optionally *soft-capped* (``softcap * tanh(logits / softcap)``, Gemma-2), and
*hidden* (-inf) where the query does not attend the key: later tokens, and keys at least
``window`` tokens back (a sliding window: each query sees the ``window`` latest tokens,
itself included, as transformers' masks say). *Sinks* (one learned logit per head, GPT-OSS)
join every query's softmax as a key whose value is zero: they take probability mass and
give nothing back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Scoring:
    """How logits are made from q.k (see the module's vocabulary); None: the plain default."""
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    def scale_for(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else self.scale

    @property
    def masked_causally(self) -> bool:
        """Whether the logits are scaled q.k, hidden only for later tokens."""
        return not self.softcap and not self.window


PLAIN = Scoring()


def logits(q, k, scoring: Scoring, offset: int = 0):
    """(logits, slope): q's logits against k, for queries ``offset`` tokens past the keys'
    block (0: the same block), with hidden entries -inf; and d logits / d (q.k) where a
    logit is not hidden, for backward (a number where there is no cap)."""
    scale = scoring.scale_for(q.shape[-1])
    raw = (q @ k.transpose(-1, -2)) * scale
    slope = scale
    if scoring.softcap:
        capped = torch.tanh(raw / scoring.softcap)
        slope = scale * (1 - capped * capped)
        raw = capped * scoring.softcap
    hidden = _hidden(q.shape[-2], k.shape[-2], offset, scoring.window, q.device)
    if hidden is not None:
        raw = raw.masked_fill(hidden, float("-inf"))
    return raw, slope


def _hidden(queries: int, keys: int, offset: int, window, device):
    """Where queries (positions offset + 0..queries-1) do not attend keys (0..keys-1); None:
    they attend all (told by the positions alone: no device sync)."""
    smallest_gap, largest_gap = offset - (keys - 1), offset + queries - 1
    if smallest_gap >= 0 and not (window and largest_gap >= window):
        return None
    gap = (torch.arange(queries, device=device).unsqueeze(1) + offset
           - torch.arange(keys, device=device))  # query position - key position
    hidden = gap < 0
    if window:
        hidden |= gap >= window
    return hidden


def sees(queries: int, keys: int, offset: int, window) -> bool:
    """Whether any of the queries attends any of the keys (see ``logits``)."""
    smallest_gap, largest_gap = offset - (keys - 1), offset + queries - 1
    return largest_gap >= 0 and not (window and smallest_gap >= window)


def causal_attention(q, k, v, scoring: Scoring = PLAIN, sinks=None):
    """Causal attention over whole sequences; ``sinks``: one logit per head, or None."""
    if scoring.masked_causally and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scoring.scale)
    scores, _ = logits(q, k, scoring)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(scores.shape[:-1] + (1,))
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v
