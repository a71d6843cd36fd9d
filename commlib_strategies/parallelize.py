"""parallelize(model, mesh, plan): apply each dimension of a layout to one model, in place
and in a fixed order, as the model family's plan (plans.py) says where: tensor parallelism,
then context parallelism (through the model's attention entry point, context_parallel.py),
then expert parallelism (expert_parallel.py).
Data parallelism and ZeRO then wrap what it returns over the mesh's dp group
(DataParallel, ZeRO), as for any model.
"""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from commlib_strategies.context_parallel import context_parallel_
from commlib_strategies.expert_parallel import expert_parallel_
from commlib_strategies.mesh import Mesh
from commlib_strategies.plans import Plan
from commlib_strategies.tensor_parallel import column_parallel_, row_parallel_


def parallelize(model: nn.Module, mesh: Mesh, plan: Plan, config=None,
                attention: str = "ring") -> nn.Module:
    """``model`` with the mesh's dimensions applied; ``config``: the family's config, whose
    head counts (``plan.heads``) tensor parallelism must divide; ``attention``: context
    parallelism's, "ulysses" or "ring"."""
    tp = mesh.size("tp")
    if tp > 1:
        tensor_parallel_(model, mesh.group("tp"), plan, config)
    if mesh.size("cp") > 1:
        heads = getattr(config, plan.heads[0]) // tp  # the query heads a rank holds
        context_parallel_(model, mesh.group("cp"), attention, heads)
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


def tensor_parallel_(model: nn.Module, group, plan: Plan, config=None) -> None:
    tp = group.size
    for attr in plan.heads:
        count = getattr(config, attr)
        if count % tp:
            raise ValueError(f"tensor parallel: the model's {attr}={count} does not divide by "
                             f"tp={tp}; each rank keeps whole heads, so choose a tp dividing "
                             f"{count}")
    for pattern, parts in plan.column.items():
        for m in _matching(model, pattern):
            column_parallel_(m, group, parts)
    for pattern in plan.row:
        for m in _matching(model, pattern):
            row_parallel_(m, group)
    for pattern, attrs in plan.per_rank.items():
        for m in _matching(model, pattern):
            for attr in attrs:
                setattr(m, attr, getattr(m, attr) // tp)
