"""parallelize(model, mesh, plan): apply each dimension of a layout to one model, in place
and in a fixed order, as the model family's plan (plans.py) says where: tensor parallelism
(with Megatron sequence parallelism if asked), then context parallelism (through the
model's attention entry point, context_parallel.py), then expert parallelism
(expert_parallel.py). Data parallelism and ZeRO then wrap what it returns over the mesh's
dp group (DataParallel, ZeRO), as for any model.
"""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from commlib_strategies.context_parallel import context_parallel_
from commlib_strategies.expert_parallel import expert_parallel_
from commlib_strategies.mappings import gather_along, gather_for_partial, split_along
from commlib_strategies.mesh import Mesh
from commlib_strategies.plans import Plan
from commlib_strategies.sequence_parallel import sum_replicated_gradients
from commlib_strategies.tensor_parallel import column_parallel_, row_parallel_


def parallelize(model: nn.Module, mesh: Mesh, plan: Plan, config=None,
                sp: str | None = None) -> nn.Module:
    """``model`` with the mesh's dimensions applied; ``config``: the family's config, whose
    head counts (``plan.heads``) tensor parallelism must divide; ``sp``: "megatron"
    (sequence parallelism on the tp ranks), or context parallelism's attention, "ulysses"
    or "ring" (the default)."""
    tp = mesh.size("tp")
    if tp > 1:
        tensor_parallel_(model, mesh.group("tp"), plan, config, sequence=sp == "megatron")
    if mesh.size("cp") > 1:
        heads = getattr(config, plan.heads[0]) // tp  # the query heads a rank holds
        context_parallel_(model, mesh.group("cp"), sp or "ring", heads)
    if mesh.size("ep") > 1:
        if not plan.experts:
            raise ValueError(f"expert parallel: the plan for {type(model).__name__} names no "
                             "experts (a model without mixture-of-experts layers)")
        for experts in _matching(model, plan.experts):
            expert_parallel_(experts, mesh.group("ep"))
    return model


def _matching(model: nn.Module, pattern: str) -> list:
    found = [m for name, m in model.named_modules() if fnmatch(name, pattern)]
    if not found:
        raise ValueError(f"the plan's pattern {pattern!r} matches no module of "
                         f"{type(model).__name__}; fix the plan (names as in "
                         "model.named_modules())")
    return found


def tensor_parallel_(model: nn.Module, group, plan: Plan, config=None,
                     sequence: bool = False) -> None:
    """Tensor parallelism by the plan, in place; with ``sequence``, Megatron sequence
    parallelism too: the residual stream is sharded along time from the first block's input
    to the final norm's output, the plan's tp regions (attention, MLP) all-gather their
    input (so an attention that derives its shapes from its input sees whole sequences) and
    their row-parallel linears reduce-scatter their output, and the parameters used on
    shards (the blocks' and the final norm's that tp does not split) sum their gradients
    over tp."""
    tp = group.size
    for attr in plan.heads:
        count = getattr(config, attr)
        if count % tp:
            raise ValueError(f"tensor parallel: the model's {attr}={count} does not divide by "
                             f"tp={tp}; each rank keeps whole heads, so choose a tp dividing "
                             f"{count}")
    time = 1 if sequence else None  # (batch, time, width) activations
    for pattern, parts in plan.column.items():
        for m in _matching(model, pattern):
            column_parallel_(m, group, parts, gathered=sequence)
    for pattern in plan.row:
        for m in _matching(model, pattern):
            row_parallel_(m, group, time)
    for pattern, attrs in plan.per_rank.items():
        for m in _matching(model, pattern):
            for attr in attrs:
                setattr(m, attr, getattr(m, attr) // tp)
    if sequence:
        _shard_sequence(model, group, plan)


def _shard_sequence(model: nn.Module, group, plan: Plan) -> None:
    if not plan.sequence:
        raise ValueError(f"megatron sequence parallel: the plan for {type(model).__name__} "
                         "names no (first block, final norm)")
    first, final, regions = plan.sequence
    names = {m: name for name, m in model.named_modules()}
    modules = dict(model.named_modules())

    def on_hidden(change):  # a pre-hook applying ``change`` to a module's hidden states
        def hook(module, args, kwargs):
            if args:
                return (change(args[0]),) + args[1:], kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        return hook

    for region in regions:  # whole sequences in, for the column-parallel linears
        for m in _matching(model, region):
            m.register_forward_pre_hook(on_hidden(lambda x: gather_for_partial(x, group, 1)),
                                        with_kwargs=True)
    for block in _matching(model, first):  # the residual stream to this rank's shard
        block.register_forward_pre_hook(on_hidden(lambda x: split_along(x, group, 1)),
                                        with_kwargs=True)
        sum_replicated_gradients(modules[names[block].rsplit(".", 1)[0]], group)  # the blocks
    for norm in _matching(model, final):
        norm.register_forward_hook(lambda m, args, out: gather_along(out, group, 1))
        sum_replicated_gradients(norm, group)
