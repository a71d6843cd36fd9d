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
    run: Optional[Callable] = None    # direct runner (native, direct, hier)
    requires: Optional[str] = None    # what it needs of a communicator (OFFERS); None: nothing


# What each transport (commlib/hosts.py) offers algorithms: the MPI library, shared memory
# among all ranks, several hosts. A communicator bootstrapped from a store (torchrun) has
# shared memory but no MPI library: "shm" less "mpi".
OFFERS = {"shm": frozenset({"shm", "mpi"}), "mpi": frozenset({"mpi"}),
          "hosts": frozenset({"hosts", "mpi"})}
_NEEDS = {"shm": "all ranks on one host with shared memory",
          "hosts": "ranks on several hosts (or COMMLIB_RANKS_PER_HOST)",
          "mpi": "the MPI library (a communicator made under mpiexec, not from a store)"}

_registry: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def register(name: str, collective: str, *, build=None, run=None, requires=None) -> None:
    if collective not in _registry:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    _registry[collective][name] = Algorithm(name, collective, build, run, requires)


def schedule(name: str, *collectives: str):
    """Decorator: register a schedule builder under ``name`` for ``collectives``."""
    def wrap(fn):
        for c in collectives:
            register(name, c, build=fn)
        return fn
    return wrap


def algorithms(collective: str, comm=None) -> list[str]:
    """Names of the algorithms for ``collective``, sorted: those that run on ``comm``, or
    every one registered when ``comm`` is None."""
    if collective not in _registry:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    return sorted(name for name, a in _registry[collective].items()
                  if comm is None or a.requires in (None, *comm.offers))


def get(collective: str, name: str, offers: frozenset | None = None) -> Algorithm:
    """The algorithm ``name``; with ``offers`` (a communicator's), one that runs there."""
    table = _registry[collective]
    valid = sorted(n for n, a in table.items()
                   if offers is None or a.requires in (None, *offers))
    if name not in table:
        raise ValueError(f"unknown algorithm {name!r} for {collective}; valid: {', '.join(valid)}")
    algo = table[name]
    if name not in valid:
        raise ValueError(f"algorithm {name!r} for {collective} needs {_NEEDS[algo.requires]}, "
                         f"which this communicator lacks; valid here: {', '.join(valid)}")
    return algo


from . import direct, hier, native, pairwise, rhd, ring, tree  # noqa: E402,F401  (register themselves)
