"""A transformers model (families.CausalLM, parallelized or not) cut into pipeline pieces by
its family's plan (``plan.pipeline``: the embeddings, the blocks' list, the final modules),
for pipeline.Pipeline's schedules.

Each piece is a copy of the model that keeps only its run of blocks (under their own
indices, so parameter names stay the model's), the embeddings on the first piece, the final
norm and LM head on the last. The model's own forward runs on every piece: the first takes
token ids, the others the hidden states before them (``inputs_embeds``; the embeddings they
lack add nothing), and every piece but the last returns hidden states (its final norm and
head are identities), so masks and positions are the model's own on every stage.
"""
from __future__ import annotations

from collections import OrderedDict
from fnmatch import fnmatch

import torch
from torch import nn

import commlib
from commlib_strategies.pipeline import PipelineStage, copy_module, partition
from commlib_strategies.plans import Plan


class _NoEmbedding(nn.Module):
    """Where a later piece's model would embed: zeros (its input is hidden states)."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)


class FamilyPiece(nn.Module):
    def __init__(self, model: nn.Module, plan: Plan, index: int, count: int, blocks: range):
        super().__init__()
        self.index, self.first, self.last = index, index == 0, index == count - 1
        embeddings, block_list, finals = plan.pipeline
        self.model = copy_module(model)  # (the whole model, then trimmed: simple, not lean)
        names = [name for name, _ in self.model.named_modules()]
        (layers,) = [self.model.get_submodule(n) for n in names if fnmatch(n, block_list)]
        layers._modules = OrderedDict((str(i), layers._modules[str(i)]) for i in blocks)
        for name in names:
            if not self.first and any(fnmatch(name, p) for p in embeddings):
                weight = self.model.get_submodule(name).weight
                self.model.set_submodule(name, _NoEmbedding(weight.shape[1], weight.dtype))
            elif not self.last and any(fnmatch(name, p) for p in finals):
                self.model.set_submodule(name, nn.Identity())

    def aux_loss(self):
        return None

    def forward(self, x, targets=None):
        out = self.model.run(input_ids=x) if self.first else self.model.run(inputs_embeds=x)
        return self.model.loss_of(out, targets) if self.last else out


class FamilyStage(PipelineStage):
    """This rank's pieces of ``model``, a transformers causal LM, for a pipeline of
    ``group.size`` stages with ``virtual`` chunks each, cut where ``plan`` says."""

    def __init__(self, model: nn.Module, plan: Plan, group: commlib.Communicator,
                 virtual: int = 1):
        nn.Module.__init__(self)
        if not plan.pipeline:
            raise ValueError(f"pipeline: the plan for {type(model).__name__} names no cut "
                             "(embeddings, blocks, final modules)")
        tied = {id(p) for name, m in model.named_modules()
                if any(fnmatch(name, e) for e in plan.pipeline[0]) for p in m.parameters()} & \
            {id(p) for name, m in model.named_modules()
             if any(fnmatch(name, f) for f in plan.pipeline[2]) for p in m.parameters()}
        if tied and group.size > 1:
            raise ValueError("pipeline: the model's LM head is tied to its embedding (GPT-2), "
                             "which the first and last stages would each hold; untie them "
                             "or train it without --pp")
        self.sequence_shards = 1
        count = group.size * virtual
        (layers,) = [m for n, m in model.named_modules() if fnmatch(n, plan.pipeline[1])]
        blocks = partition(len(layers), count)
        pieces = [FamilyPiece(model, plan, c * group.size + group.rank, count,
                              blocks[c * group.size + group.rank]) for c in range(virtual)]
        # every stage's parameter names and shapes, from the model (pieces of other stages
        # are not built here)
        layout = [[(name, p.shape) for c in range(virtual)
                   for name, p in _held(model, plan, c * group.size + s, count,
                                        blocks[c * group.size + s])]
                  for s in range(group.size)]
        placed = {name for stage in layout for name, _ in stage}
        stray = [name for name, _ in model.named_parameters() if name not in placed]
        if stray:
            raise ValueError(f"pipeline: parameters {stray[:3]} lie outside the plan's cut "
                             "(embeddings, blocks, final modules); name their modules there")
        self._setup(model.config, group, pieces, layout, unsplittable=None)

    def named_reference_parameters(self):
        for piece in self.pieces:
            yield from piece.model.named_parameters()


def _held(model, plan: Plan, index: int, count: int, blocks: range) -> list:
    """(name, parameter) of ``model`` that piece ``index`` holds, in the piece's order."""
    embeddings, block_list, finals = plan.pipeline
    (list_name,) = [n for n, _ in model.named_modules() if fnmatch(n, block_list)]
    prefixes = [f"{list_name}.{i}." for i in blocks]

    def held(name):
        module = name.rsplit(".", 1)[0]
        return (any(name.startswith(p) for p in prefixes)
                or index == 0 and any(fnmatch(module, e) for e in embeddings)
                or index == count - 1 and any(fnmatch(module, f) for f in finals))
    return [(name, p) for name, p in model.named_parameters() if held(name)]
