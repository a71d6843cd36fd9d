"""hosts: ranks on several hosts, as many on each: the net transport (TCP between the
hosts, csrc/net.h), plus hier (commlib/algorithms/hier.py) over a shm transport inside each
host and a net one between. COMMLIB_CROSS=mpi joins them through MPI instead (its
point-to-point messages and its agreement), as before the net transport.
HostLayout is what hier's runners use, shared with gloo's hosts transport (transports/gloo.py,
torchrun's nodes).

Vocabulary: ``local`` holds this rank's host-mates ordered by rank, ``cross`` the ranks
with the same local rank on every host; ``position[r]`` is rank r's (local rank, cross
rank) and ``owner[i][h]`` the rank at position (i, h); ``host_of[r]`` names rank r's
host, and ``cross_rank_of_host[host]`` is the cross rank of this rank's peer there.
"""
from __future__ import annotations

from dataclasses import replace


from .mpi import MpiTransport
from .mpi_world import MpiWorld, host_color
from .net import NetTransport, over_net
from .shm import ShmTransport


class HostLayout:
    """Mixed into a transport of the whole world: its ranks as ``local`` x ``cross``."""

    def join_hosts(self, world, color: int, local_cls, cross_cls, cross: str) -> None:
        """Split ``world`` by host (``color``: shared exactly by host-mates) into a
        ``local_cls`` transport per host and a ``cross_cls`` one per local rank. Collective."""
        local = world.split(color, world.rank)
        self.local = local_cls(local)
        self.cross = cross_cls(world.split(local.rank, world.rank))
        placed = world.allgather((self.local.rank, self.cross.rank, color))
        self.position = [(i, h) for i, h, _ in placed]
        self.owner = [[0] * self.cross.size for _ in range(self.local.size)]
        for r, (i, h) in enumerate(self.position):
            self.owner[i][h] = r
        # (a host's place in the cross groups may differ between them: ranks in any order)
        self.host_of = [c for _, _, c in placed]
        self.cross_rank_of_host = {c: h for i, h, c in placed if i == self.local.rank}
        self.where = replace(self.local.where, transport=self.name, local=self.local.size,
                             cross=cross, checked=self.checks_calls)

    def parts(self) -> tuple:
        return self.local, self.cross

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


class HostsTransport(HostLayout, NetTransport):
    name = "hosts"
    offers = frozenset({"hosts", "mpi", "schedules", "eager"})

    def __init__(self, world, color: int | None = None, local_cls=ShmTransport):
        """Over an MpiWorld, or a StoreWorld (torchrun's) with its host's ``color`` and the
        store's shm transport as ``local_cls``."""
        super().__init__(world)
        self.join_hosts(world, host_color(world.coll) if color is None else color, local_cls,
                        NetTransport, "net")

    @staticmethod
    def suits(world) -> bool:
        hosts, even = world.hosts
        return hosts > 1 and even

    @classmethod
    def create(cls, world):
        """Joined by net (TCP), or with COMMLIB_CROSS=mpi by MPI (HostsOverMpi)."""
        return cls(world) if over_net() else HostsOverMpi(world)


class HostsOverMpi(HostLayout, MpiTransport):
    """The hosts transport with MPI's messages and agreement between the hosts."""
    name = "hosts"
    offers = HostsTransport.offers

    def __init__(self, world: MpiWorld):
        super().__init__(world)
        self.join_hosts(world, host_color(world.coll), ShmTransport, MpiTransport, "mpi")
