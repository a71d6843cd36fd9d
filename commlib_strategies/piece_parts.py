"""What a pipeline piece (pipeline.Piece) puts where its copy of the model leaves modules
out, so that the model's own forward runs the piece unchanged:

    Skipped      another piece's block: passes its input on, in the form the block
                 returns (block_outputs.py), with the block's plain attributes (a model may
                 read what a block is: Dory's ``attention_type``, Nemotron-H's
                 ``block_type``)
    NoEmbedding  where a later piece's model would embed: zeros of the embedding's width
    Final        a final module (the final norm, the LM head) on a piece but the last: once
                 the blocks ran, passes its input on, and the first to run records it as
                 the piece's output; before them it is the module itself where that holds
                 no parameters (NanoChat normalizes its embeddings with its final norm too)
"""
from __future__ import annotations

import torch
from torch import nn

from commlib_strategies.block_outputs import values_returned


class Skipped(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        for key, value in vars(block).items():
            if not key.startswith("_") and key != "training" and \
                    isinstance(value, (str, int, float, bool)):
                setattr(self, key, value)
        self.values = values_returned(type(block).forward)

    def forward(self, hidden, *args, **kwargs):
        return (hidden, *[None] * (self.values - 1)) if self.values else hidden


class NoEmbedding(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.width = width
        # an empty weight: a model may ask the embedding's for its device (Llama-4)
        self.register_buffer("weight", torch.empty(0, width, dtype=dtype), persistent=False)

    def forward(self, ids):
        return self.weight.new_zeros(*ids.shape, self.width)


class Final(nn.Module):
    """``passed``: [the piece's output]; ``blocks_ran``: [whether the blocks' list ran in
    this forward]; both the piece's, reset by it."""

    def __init__(self, name: str, module: nn.Module, passed: list, blocks_ran: list):
        super().__init__()
        self.name, self.passed, self.blocks_ran = name, passed, blocks_ran
        self.before = None if any(True for _ in module.parameters()) else module
        self._forward_hooks.update(module._forward_hooks)  # (Megatron SP's gather)
        self.register_forward_hook(_record)

    def forward(self, x, *args, **kwargs):
        if self.blocks_ran[0]:
            return x
        if self.before is None:
            raise ValueError(f"pipeline: the final module {self.name} also runs before the "
                             "blocks, and its parameters are on the last piece only; pass a "
                             "Plan whose final modules run after the blocks alone")
        return self.before.forward(x, *args, **kwargs)  # (its hooks are this one's)


def _record(final, args, out):
    if final.blocks_ran[0] and final.passed[0] is None:
        final.passed[0] = out
