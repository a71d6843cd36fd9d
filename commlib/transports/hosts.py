"""hosts: ranks on several hosts, as many on each: the mpi transport, plus hier
(commlib/algorithms/hier.py) over a shm transport inside each host and an mpi one between.

Vocabulary: ``local`` holds this rank's host-mates ordered by rank, ``cross`` the ranks
with the same local rank on every host; ``position[r]`` is rank r's (local rank, cross
rank) and ``owner[i][h]`` the rank at position (i, h).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..buffers import Buffer
from .mpi import MpiTransport
from .mpi_world import MpiWorld, host_color
from .shm import ShmTransport


class HostsTransport(MpiTransport):
    name = "hosts"
    offers = frozenset({"hosts", "mpi"})

    def __init__(self, world: MpiWorld):
        super().__init__(world)
        coll, me = world.coll, world.rank
        local = coll.Split(host_color(coll), me)
        cross = coll.Split(local.Get_rank(), me)
        self.local = ShmTransport(MpiWorld(local, owned=True))
        self.cross = MpiTransport(MpiWorld(cross, owned=True))
        self.position = world.allgather((self.local.rank, self.cross.rank))
        self.owner = [[0] * self.cross.size for _ in range(self.local.size)]
        for r, (i, h) in enumerate(self.position):
            self.owner[i][h] = r
        self.where = replace(self.local.where, transport=self.name, local=self.local.size)
        self._scratch: dict = {}

    @staticmethod
    def suits(world) -> bool:
        hosts, even = world.hosts
        return hosts > 1 and even

    def scratch(self, slot: int, numel: int, dtype) -> Buffer:
        """Reused working buffer ``slot`` (fresh pages would cost more than the copies)."""
        nbytes = numel * dtype.itemsize
        raw = self._scratch.get(slot)
        if raw is None or raw.size < nbytes:
            raw = self._scratch[slot] = np.empty(nbytes, np.uint8)
        return Buffer(raw, raw.ctypes.data, numel, dtype, raw[:nbytes])

    def set_timeout(self, seconds: float) -> None:
        """Each stage of hier is bounded by its call's timeout too."""
        super().set_timeout(seconds)
        for t in (self.local, self.cross):
            t.set_timeout(seconds)

    @property
    def bytes_sent(self) -> int:
        return super().bytes_sent + self.local.bytes_sent + self.cross.bytes_sent

    def close(self) -> None:
        for t in (self.local, self.cross):
            t.close()
        super().close()
