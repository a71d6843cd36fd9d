"""parallelize(model, mesh, plan): apply each dimension of a layout to one model, in place
and in a fixed order, as the model family's plan (plans.py) says where: tensor parallelism
(with Megatron sequence parallelism if asked, megatron_sp.py), then context parallelism
(through the model's attention core, context_parallel.py), then expert parallelism
(expert_parallel.py). Data parallelism and ZeRO then wrap what it returns over the mesh's
dp group (DataParallel, ZeRO), and pipeline.PipelineStage cuts it over pp, as for any model.

The model is a model.LanguageModel (the project's GPT, a transformers family's from
families.py), or a transformers causal LM as transformers built it, which parallelize
wraps into a families.CausalLM (``model(ids) -> logits``, ``model.loss``; the original
is its ``hf``) and returns: use what it returns.
"""
from __future__ import annotations

import torch
from torch import nn

from commlib_strategies.config_plans import from_config
from commlib_strategies.context_parallel import context_parallel_
from commlib_strategies.expert_parallel import expert_parallel_
from commlib_strategies.mappings import copy_to_group
from commlib_strategies.megatron_sp import shard_sequences_
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import LanguageModel
from commlib_strategies.plans import Plan, matching, matching_parameters
from commlib_strategies.sequence_parallel import sum_gradient_over
from commlib_strategies.tensor_parallel import (column_parameter_, column_parallel_,
                                                row_parallel_, vocab_parallel_)


def parallelize(model: nn.Module, mesh: Mesh, plan: Plan | None = None,
                sp: str | None = None) -> nn.Module:
    """``model`` with the mesh's dimensions applied where ``plan`` says (None: the plan a
    transformers model's own config carries, config_plans.py); ``sp``: "megatron" (sequence
    parallelism on the tp ranks), or context parallelism's attention, "ulysses" or "ring"
    (the default). The model's ``architecture()`` holds the head counts (``plan.heads``)
    that tensor parallelism must divide. A transformers model comes back wrapped (a
    families.CausalLM over it): a ``plan`` for it names the wrapper's modules (``hf.``
    first)."""
    tp, cp = mesh.size("tp"), mesh.size("cp")
    if not isinstance(model, LanguageModel):
        from commlib_strategies.families import causal_lm  # (transformers' models only)
        model = causal_lm(model)
    plan = plan or from_config(model)

    if sp not in (None, "megatron", "ulysses", "ring"):
        raise ValueError(f"parallelize: sp={sp!r}; choose None, 'megatron', 'ulysses' or "
                         "'ring'")
    if sp == "megatron" and tp == 1 or sp in ("ulysses", "ring") and cp == 1:
        raise ValueError(f"parallelize: sp={sp!r} does not fit the mesh's tp={tp}, cp={cp}: "
                         "'megatron' shards the sequences over tp >= 2, 'ulysses' and 'ring' "
                         "over cp >= 2")
    if tp > 1:
        tensor_parallel_(model, mesh.group("tp"), plan, sequence=sp == "megatron")
    if cp > 1:
        heads = getattr(model.architecture(), plan.heads[0])  # query heads on each rank
        heads //= tp if plan.heads_split else 1
        context_parallel_(model, mesh.group("cp"), sp or "ring", heads,
                          matching(model, plan.attention))
    if plan.experts:
        expert_parallel_(model, matching(model, plan.experts, names=True), mesh, sp)
    elif mesh.size("ep") > 1:
        raise ValueError(f"expert parallel: the plan for {type(model).__name__} names no "
                         "experts (a model without mixture-of-experts layers, or whose "
                         "config gives no expert parallel plan: pass a Plan naming them)")
    return model


def tensor_parallel_(model: nn.Module, group, plan: Plan, sequence: bool = False) -> None:
    """Tensor parallelism by the plan, in place; with ``sequence``, Megatron sequence
    parallelism too (megatron_sp.py)."""
    tp = group.size
    for attr in plan.heads if plan.heads_split else ():
        count = getattr(model.architecture(), attr)
        if count % tp:
            raise ValueError(f"tensor parallel: the model's {attr}={count} does not divide by "
                             f"tp={tp}; each rank keeps whole heads, so choose a tp dividing "
                             f"{count}")
    time = 1 if sequence else None  # (batch, time, width) activations
    for pattern, parts in plan.column.items():
        for m in matching(model, pattern):
            column_parallel_(m, group, parts, gathered=sequence)
    for pattern in plan.row:
        for m in matching(model, pattern):
            row_parallel_(m, group, time)
    for pattern in plan.column_gather:
        for m in matching(model, pattern):
            column_parallel_(m, group, gathered=sequence, gather_output=True)
    for pattern in plan.row_split:
        for m in matching(model, pattern):
            row_parallel_(m, group, time, split_input=True)
    for pattern in plan.column_params:
        for owner, name in matching_parameters(model, pattern):
            column_parameter_(owner, name, group)
    for pattern in plan.tp_summed:
        for m in matching(model, pattern):
            for p in m.parameters():
                sum_gradient_over(p, group)
    for pattern, attr in plan.shared_tail.items():
        if sequence:
            raise ValueError(f"tensor parallel: Megatron sequence parallelism does not take "
                             f"{pattern} (kept whole, its last {attr} features read by each "
                             "rank's heads: MLA's kv_a_proj_with_mqa); train without "
                             "--sp megatron")
        features = getattr(model.architecture(), attr)
        for m in matching(model, pattern):
            m.register_forward_hook(lambda m, args, out, n=features: torch.cat(
                [out[..., :-n], copy_to_group(out[..., -n:], group)], -1))
    for pattern, attrs in plan.per_rank.items():
        for m in matching(model, pattern):
            for attr in attrs:
                setattr(m, attr, getattr(m, attr) // tp)
    if plan.vocab:
        embedding, head = plan.vocab
        embeddings = matching(model, embedding) if embedding else []
        tied = {id(m.weight): m for m in embeddings}  # (a head sharing its embedding's rows)
        for m in embeddings:
            vocab_parallel_(m, group)
        for m in matching(model, head):
            shared = tied.get(id(m.weight))
            column_parallel_(m, group, pad=True)
            if shared is not None:  # the same rows of the vocab as the embedding's: one
                m.weight = shared.weight  # parameter again, as in one process
        model.vocab_group = group
    if sequence:
        shard_sequences_(model, group, plan)
