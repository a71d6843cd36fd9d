"""The registry's entries and their lookups: what an algorithm is (Algorithm), how one
registers (register, the schedule decorator), its terms on shared memory (shm_terms), and
the queries select.py and the tools ask (entries, candidates, get, unavailable). The
algorithm modules import this, and the package imports them: no module imports its package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

from ..collectives import COLLECTIVES, of as collective_of

# What an entry may need, as a transport offers it (commlib/transports/), and how an error
# names it.
NEEDS = {"schedules": "a transport that runs schedules (shared memory or MPI; not gloo, which "
                      "joins the nodes of a torchrun job)",
         "shm": "all ranks on one host with shared memory",
         "eager": "ranks that agree on each call through messages (the mpi, hosts and "
                  "gloo transports)",
         "one_copy": "all ranks on one host, each able to read and write the others' memory "
                     "with process_vm_readv and process_vm_writev (probed at set-up; off "
                     "where the host forbids them, or with COMMLIB_ONE_COPY=0)",
         "hosts": "ranks on several hosts (or COMMLIB_RANKS_PER_HOST)",
         "mpi": "the MPI library (a communicator made under mpiexec, not from a store)",
         "gloo": "torch's gloo (ranks that met through a store on several hosts)",
         "cuda_ipc": "CUDA arrays on one device and 2 to 16 ranks of one host sharing memory",
         "cuda_mpi": "CUDA arrays and a CUDA-aware MPI"}


@dataclass(frozen=True)
class Algorithm:
    name: str
    collective: str
    cost: Callable  # cost(model, where, n, nbytes) -> {constant: coefficient}
    build: Optional[Callable] = None  # schedule builder
    run: Optional[Callable] = None    # runner: run(transport, call)
    needs: Optional[str] = None       # a capability (NEEDS) a transport offers; None: any
    memory: str = "host"
    family: Optional[str] = None  # a name that asks for the cheapest of several (ipc)
    applies: Optional[Callable] = None  # applies(transport, call) -> why it cannot, or None
    # refuses(n, nbytes, where=None) -> why not at that size (there; None: MPI), or None
    refuses: Optional[Callable] = None
    agrees: bool = False  # its run checks that the ranks made the same call (no agreement)
    user_ops: bool = True  # reduces with user-defined ops too (commlib/user_ops.py)
    # reduces every element in rank order, ((x0 op x1) op x2) ..., whatever the size: the
    # same bits as every other such algorithm (deterministic mode)
    rank_order: bool = False
    # one_copy's, chosen by the call's memory (pages.py): what stages the call where some
    # rank's memory is not read in place (a schedule, or None: as direct does)
    otherwise: Optional["Algorithm"] = None
    # one_copy's, auto's route for memory every rank maps (pages.py's in_regions): it reads
    # in place only where every rank's buffer lies in a region (Communicator.empty)
    only_regions: bool = False


_registry: dict[tuple[str, str], dict[str, Algorithm]] = {
    (c, m): {} for c in COLLECTIVES for m in ("host", "device")}


def register(name: str, collective: str, cost, **fields) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    entry = Algorithm(name, collective, cost, **fields)
    _registry[collective, entry.memory][name] = entry


def schedule(name: str, collective: str, formula):
    """Decorator: register a schedule builder, whose ``formula(n, N)`` gives (rounds, bytes
    moved, bytes reduced) over MPI; on shared memory its own copies count (shm_terms)."""
    def wrap(build):
        register(name, collective, lambda model, where, n, nbytes: schedule_terms(
            collective, name, formula, where, n, nbytes), build=build, needs="schedules")
        return build
    return wrap


def schedule_terms(collective, name, formula, where, n, nbytes) -> dict:
    if where.transport == "shm":
        rounds, copied, reduced = shm_terms(collective, name, n, nbytes)
        return {"alpha_shm": max(rounds, 1), "beta_shm": copied, "gamma_shm": reduced}
    if n == 1:
        return {"alpha": 1}
    rounds, moved, reduced = formula(n, nbytes)
    return {"alpha": rounds, "beta": moved, "gamma": reduced}


@lru_cache(maxsize=2048)
def shm_terms(collective: str, name: str, n: int, nbytes: int) -> tuple:
    """(rounds, bytes copied, bytes reduced) of the busiest rank when schedule ``name``
    runs on shared memory: sends and plain receives and local copies each copy their
    bytes once; a reducing receive reduces them."""
    params, kind = {}, collective_of(collective)
    if kind.rooted:
        params["root"] = 0
    if kind.uneven:
        base, extra = divmod(nbytes, n)
        splits = tuple(base + (i < extra) for i in range(n))
        params.update(input_splits=splits, output_splits=splits)
    worst = (0, 0, 0)
    for rank in range(n):
        sched = get(collective, name).build(n, rank, nbytes, 1, **params)
        copied = reduced = 0
        for rnd in sched.rounds:
            for step in rnd.steps:
                if type(step).__name__ == "RecvReduce":
                    reduced += step.dst.count
                else:
                    copied += (step.src if hasattr(step, "src") else step.dst).count
        worst = max(worst, (len(sched.rounds), copied, reduced), key=lambda t: t[1] + t[2])
    return worst


def log2_rounds(n: int) -> int:
    """Rounds of a binomial tree or of recursive doubling among n ranks."""
    return math.ceil(math.log2(n))


def entries(collective: str, memory: str = "host") -> dict[str, Algorithm]:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    return _registry[collective, memory]


def candidates(collective: str, offers: frozenset | None, device: bool = False) -> list:
    """The entries that can run on a communicator offering ``offers`` (None: any), sorted by
    name: host memory's, or for GPU arrays the device entries and, staged, the host ones."""
    found = list(entries(collective).values())
    if device:
        found += entries(collective, "device").values()
    return sorted((a for a in found if offers is None or a.needs in (None, *offers)),
                  key=lambda a: (a.name, a.memory))


def algorithms(collective: str, comm=None, device: bool = False) -> list[str]:
    """Names of the algorithms for ``collective`` that run on ``comm`` (None: any), for host
    memory or (``device``) GPU arrays (the GPU's own, and the host ones staged)."""
    offers = None if comm is None else comm.offers
    return sorted({a.name for a in candidates(collective, offers, device)})


def get(collective: str, name: str, offers: frozenset | None = None,
        device: bool = False) -> Algorithm:
    """The algorithm ``name`` that runs where ``offers`` (None: anywhere), on GPU arrays
    (``device``: its GPU entry first) or host memory; else ValueError saying why."""
    here = [a for a in candidates(collective, offers, device) if a.name == name]
    if here:
        return max(here, key=lambda a: a.memory == "device")
    raise unavailable(collective, name, offers, device)


def unavailable(collective: str, name: str, offers, device: bool, why: str | None = None):
    """The error for an algorithm (or family) asked for that cannot run here: what it
    needs (or ``why``), and what can."""
    valid = ", ".join(sorted({a.name for a in candidates(collective, offers, device)}))
    known = [a for m in ("host", "device") for a in entries(collective, m).values()
             if name in (a.name, a.family)]
    if not known:
        return ValueError(f"unknown algorithm {name!r} for {collective}; valid: {valid}")
    return ValueError(f"{collective}: algorithm={name!r} needs {why or NEEDS[known[0].needs]}, "
                      f"which this call lacks; valid here: {valid}")
