"""parallelize(model, mesh, plan): apply each dimension of a layout to one model, in place
and in a fixed order, as the model family's plan (plans.py) says where: tensor parallelism,
then context parallelism (through the model's attention entry point, context_parallel.py).
Data parallelism and ZeRO then wrap what it returns over the mesh's dp group
(DataParallel, ZeRO), as for any model.
"""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from commlib_strategies.context_parallel import context_parallel_
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
    return model


def tensor_parallel_(model: nn.Module, group, plan: Plan, config=None) -> None:
    tp = group.size
    for attr in plan.heads:
        count = getattr(config, attr)
        if count % tp:
            raise ValueError(f"tensor parallel: the model's {attr}={count} does not divide by "
                             f"tp={tp}; each rank keeps whole heads, so choose a tp dividing "
                             f"{count}")
    modules = dict(model.named_modules())

    def matching(pattern: str) -> list:
        found = [m for name, m in modules.items() if fnmatch(name, pattern)]
        if not found:
            raise ValueError(f"the plan's pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}; fix the plan (names as in "
                             "model.named_modules())")
        return found

    for pattern, parts in plan.column.items():
        for m in matching(pattern):
            column_parallel_(m, group, parts)
    for pattern in plan.row:
        for m in matching(pattern):
            row_parallel_(m, group)
    for pattern, attrs in plan.per_rank.items():
        for m in matching(pattern):
            for attr in attrs:
                setattr(m, attr, getattr(m, attr) // tp)
