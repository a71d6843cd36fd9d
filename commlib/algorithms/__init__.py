"""Algorithm registry: one module per algorithm family registers what it implements.

An algorithm is either a *schedule builder* ``build(size, rank, count, itemsize, **params)
-> Schedule`` run by an executor, or a *direct runner* (``native``: the MPI library's own
collective). ``count`` is the per-rank element count of the collective's primary buffer:
the tensor for all_reduce/broadcast/reduce, the output block for reduce_scatter, the input
for all_gather; all_to_all takes ``input_splits``/``output_splits`` instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")


@dataclass(frozen=True)
class Algorithm:
    name: str
    collective: str
    build: Optional[Callable] = None  # schedule builder
    run: Optional[Callable] = None    # direct runner (native)


_registry: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def register(name: str, collective: str, *, build=None, run=None) -> None:
    if collective not in _registry:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    _registry[collective][name] = Algorithm(name, collective, build, run)


def schedule(name: str, *collectives: str):
    """Decorator: register a schedule builder under ``name`` for ``collectives``."""
    def wrap(fn):
        for c in collectives:
            register(name, c, build=fn)
        return fn
    return wrap


def algorithms(collective: str) -> list[str]:
    """Names of the algorithms available for ``collective``, sorted."""
    if collective not in _registry:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    return sorted(_registry[collective])


def get(collective: str, name: str) -> Algorithm:
    table = _registry[collective]
    if name not in table:
        raise ValueError(f"unknown algorithm {name!r} for {collective}; "
                         f"valid: {', '.join(sorted(table))}")
    return table[name]


from . import native, pairwise, rhd, ring, tree  # noqa: E402,F401  (register themselves)
