"""Which ranks share a host, and the transport a communicator therefore uses.

    shm    every rank on one host: schedules run on the shared-memory executor, and the
           host-only algorithms (direct) are available
    mpi    schedules run on the mpi4py executor (between hosts, or COMMLIB_TRANSPORT=mpi)
    hosts  ranks on several hosts: mpi, plus hierarchical algorithms that use shared
           memory inside each host and MPI between them

COMMLIB_RANKS_PER_HOST=k pretends that world ranks [0, k), [k, 2k), ... are separate
hosts, so the multi-host path can be tested on one machine.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from .exchange import allgather

TRANSPORTS = ("auto", "shm", "mpi")


def requested_transport() -> str:
    value = os.environ.get("COMMLIB_TRANSPORT", "auto")
    if value not in TRANSPORTS:
        raise ValueError(f"COMMLIB_TRANSPORT={value!r}; valid: {', '.join(TRANSPORTS)}")
    return value


def host_color(mpi_comm: MPI.Comm) -> int:
    """An id shared exactly by the ranks of ``mpi_comm`` on this rank's (virtual) host."""
    per_host = os.environ.get("COMMLIB_RANKS_PER_HOST")
    if per_host:
        if not per_host.isdigit() or int(per_host) < 1:
            raise ValueError(f"COMMLIB_RANKS_PER_HOST={per_host!r}; expected a positive int")
        return MPI.COMM_WORLD.Get_rank() // int(per_host)
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:  # the lowest world rank on the node names it
        lowest = np.array([MPI.COMM_WORLD.Get_rank()], np.int64)
        node.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
        return int(lowest[0])
    finally:
        node.Free()


def affinity() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@lru_cache(maxsize=1)
def crowded_host() -> bool:
    """Whether this machine's MPI processes (all of them, whatever communicator or virtual
    hosts) outnumber the cores they may run on: the union of their affinities, since a
    launcher that binds each rank to its own core (Open MPI does) leaves each one core."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = set().union(*allgather(node, sorted(affinity())))
        return node.Get_size() > len(cores)
    finally:
        node.Free()


def count_hosts(mpi_comm: MPI.Comm) -> tuple[int, bool]:
    """(number of hosts, whether every host has the same number of ranks); collective."""
    colors = allgather(mpi_comm, host_color(mpi_comm))
    sizes = {colors.count(c) for c in colors}
    return len(set(colors)), len(sizes) == 1


class HostLayout:
    """This communicator's ranks grouped by host (every host with the same number of
    ranks): ``local`` holds this rank's host-mates ordered by rank, ``cross`` the ranks
    with the same local rank on every host; ``position[r]`` is rank r's (local rank, cross
    rank) and ``owner[i][h]`` the rank at position (i, h)."""

    def __init__(self, mpi_comm: MPI.Comm, make_communicator):
        local = mpi_comm.Split(host_color(mpi_comm), mpi_comm.Get_rank())
        cross = mpi_comm.Split(local.Get_rank(), mpi_comm.Get_rank())
        self.local = make_communicator(local, "shm")
        self.cross = make_communicator(cross, "mpi")
        self.position = allgather(mpi_comm, (self.local.rank, self.cross.rank))
        self.owner = [[0] * self.cross.size for _ in range(self.local.size)]
        for r, (i, h) in enumerate(self.position):
            self.owner[i][h] = r
        self._scratch: dict = {}

    def scratch(self, slot: int, numel: int, dtype):
        """Reused working buffer number ``slot`` (fresh pages every call would cost more
        than the copies); one collective at a time uses them."""
        from .buffers import Buffer
        nbytes = numel * dtype.itemsize
        raw = self._scratch.get(slot)
        if raw is None or raw.size < nbytes:
            raw = self._scratch[slot] = np.empty(nbytes, np.uint8)
        return Buffer(raw, raw.ctypes.data, numel, dtype, raw[:nbytes])

    def bound(self, seconds) -> None:
        """Bound each sub-collective of the next call by that call's timeout (hier's
        all_reduce also drives the local transport directly)."""
        for c in (self.local, self.cross):
            c.timeout = seconds
        self.local._executor.set_timeout(seconds)

    def free(self):
        for c in (self.local, self.cross):
            c.free()
            c.mpi.Free()
