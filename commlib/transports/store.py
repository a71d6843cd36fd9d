"""store: the shm transport among processes that meet through a key-value store instead of
MPI, for launchers such as torchrun (each process alone in its MPI world, all sharing
torch.distributed's TCPStore). Set-up facts travel through the store, then collectives run
on shared memory as under mpiexec, and across hosts over TCP (the net transport).
Point-to-point messages go through the store itself: correct (MPI's order per source and
tag is kept) but slow. Values put in the store are JSON or raw bytes: nothing received
from a peer is unpickled.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import timedelta

import numpy as np

from .. import survivors
from ..errors import CommError
from ..work import Work, finished, in_thread
from .base import affinity
from .hosts import HostsTransport
from .net import NetTransport, over_net
from .shm import ShmTransport


def wait_get(store, key: str, what: str, gone=None) -> bytes:
    """``store.get(key)`` once the key exists, within the store's timeout: polled, as a
    blocking get would hold the store's one connection (a send could not go out). Raises
    at once where ``gone()`` says the process that would set it has exited."""
    timeout = getattr(store, "timeout", timedelta(minutes=5)).total_seconds()
    deadline, nap = time.monotonic() + timeout, 50e-6
    while not store.check([key]):
        if gone is not None and gone() and not store.check([key]):
            raise CommError(f"{what}: its process has exited (or, on another host, "
                            f"stopped its pulse)")
        if time.monotonic() > deadline:
            raise CommError(f"{what}: nothing arrived within the store's timeout "
                            f"({timeout:.0f} s; key {key!r})")
        time.sleep(nap)
        nap = min(2 * nap, 5e-3)
    return store.get(key)


class StoreWorld:
    """A communicator's ranks as members of a store group (an MpiWorld's counterpart). A
    message is one key, numbered per (source, destination, tag) in issue order, so that
    messages of one tag arrive in order; the receiver deletes it; sends complete at once."""

    offers = frozenset()  # no MPI library: no native
    takes_device_memory = False
    mpi = coll = None

    def __init__(self, store, rank: int, size: int, prefix: str, members=None, peers=None,
                 pulses=None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self.store, self.rank, self.size, self.prefix = store, rank, size, prefix
        # the first group's ranks of this one's, in rank order
        self.members = tuple(range(size)) if members is None else tuple(members)
        # each rank's (host, pid), where known: a set-up wait for a rank that exited fails
        # at once, and survivors.agree leaves it out
        self.peers = None if peers is None else tuple(tuple(p) for p in peers)
        self.pulses = pulses  # survivors.Pulses, where the ranks span hosts
        self.shrinks = 0  # attempts at shrinking this world so far
        self.rounds = 0  # allgathers so far: names each one's keys
        self._numbered: dict = {"sent": Counter(), "posted": Counter()}
        self._lock = threading.Lock()
        self.bytes_sent = 0  # by sends

    def allgather(self, value) -> list:
        """Every member's JSON-able ``value``, in rank order (each member makes the same
        sequence of calls)."""
        self.rounds += 1
        key = f"{self.prefix}/gather{self.rounds}"
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        return [json.loads(wait_get(self.store, f"{key}/{r}", f"set-up waiting for {self.who(r)}"
                                    " (did every process of the group start?)",
                                    self.peers and (lambda r=r: survivors.gone(self, r))))
                for r in range(self.size)]

    def who(self, r: int) -> str:
        return f"rank {r}" + (f" (pid {self.peers[r][1]})" if self.peers else "")

    def shrunk(self, timeout: float) -> "StoreWorld":
        """A world of this one's ranks that are still alive (survivors.agree); collective
        over them."""
        self.shrinks += 1
        alive = survivors.agree(self, self.shrinks, timeout)
        return StoreWorld(self.store, alive.index(self.rank), len(alive),
                          f"{self.prefix}/shrink{self.shrinks}",
                          [self.members[r] for r in alive], [self.peers[r] for r in alive],
                          self.pulses)

    def cores_each(self) -> float:
        """The cores the group's processes may run on, over how many they are (the group is
        all that is known of the machine)."""
        return len(set().union(*self.allgather(affinity()))) / self.size

    def split(self, color, key) -> "StoreWorld | None":
        choices = self.allgather([color, key])
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(choices) if c == color)
        return StoreWorld(self.store, members.index((key, self.rank)), len(members),
                          f"{self.prefix}/split{self.rounds}/{color}",
                          [self.members[r] for _, r in members],
                          self.peers and [self.peers[r] for _, r in members], self.pulses)

    def dup(self) -> "StoreWorld":
        return self.split(0, self.rank)

    def make_transport(self):
        return StoreTransport(self)

    def _key(self, src: int, dst: int, tag: int, which: str) -> str:
        with self._lock:  # sends and receives may be issued from several threads
            counter = self._numbered[which]
            seq = counter[(src, dst, tag)]
            counter[(src, dst, tag)] = seq + 1
        return f"{self.prefix}/p2p/{src}->{dst}/{tag}/{seq}"

    def send(self, buf, dst: int, tag: int, deadline, async_op: bool, keep):
        self.bytes_sent += buf.nbytes
        self.store.set(self._key(self.rank, dst, tag, "sent"), buf.bytes.tobytes())
        return finished(f"send to rank {dst}") if async_op else None

    def recv(self, buf, src: int | None, tag: int, deadline, async_op: bool, keep):
        """Receive from ``src`` (None: any rank: the first message of ``tag`` to arrive from
        any, claimed then)."""
        work = Work(f"recv from {'any rank' if src is None else f'rank {src}'}", src)
        # a source's message is claimed now: receives from it match in order
        key = None if src is None else self._key(src, self.rank, tag, "posted")

        def task():
            claimed, work.source = (key, src) if key else self._claim_any(tag)
            data = wait_get(self.store, claimed, f"recv from {self.who(work.source)} (tag "
                            f"{tag})", self.peers and (lambda: survivors.gone(self,
                                                                              work.source)))
            self.store.delete_key(claimed)
            if len(data) != buf.nbytes:
                raise CommError(f"recv from rank {work.source}: got {len(data)} bytes, "
                                f"tensor holds {buf.nbytes}")
            buf.bytes[:] = np.frombuffer(data, np.uint8)
            return keep
        return in_thread(work.what, task, work) if async_op else task()

    def _claim_any(self, tag: int) -> tuple[str, int]:
        """The key of the first message of ``tag`` that arrives from any peer, claimed, and
        that peer."""
        timeout = getattr(self.store, "timeout", timedelta(minutes=5)).total_seconds()
        deadline, nap = time.monotonic() + timeout, 50e-6
        while time.monotonic() < deadline:
            with self._lock:
                posted = self._numbered["posted"]
                for src in range(self.size):
                    key = (f"{self.prefix}/p2p/{src}->{self.rank}/{tag}/"
                           f"{posted[(src, self.rank, tag)]}")
                    if src != self.rank and self.store.check([key]):
                        posted[(src, self.rank, tag)] += 1
                        return key, src
            time.sleep(nap)
            nap = min(2 * nap, 5e-3)
        raise CommError(f"recv from any rank (tag {tag}): nothing arrived within the store's "
                        f"timeout ({timeout:.0f} s)")

    def close(self) -> None:
        pass


class StoreTransport(ShmTransport):
    """The shm transport over a StoreWorld: all ranks on one host."""

    @staticmethod
    def suits(world) -> bool:
        return False  # made from a store (Communicator.from_store), never picked for MPI

    @classmethod
    def create(cls, store, rank: int, size: int, prefix: str):
        """The transport of ranks that meet through ``store``: this one on one host; on
        several, as ``over`` says. Collective."""
        world = StoreWorld(store, rank, size, prefix)
        world.peers = tuple(tuple(p) for p in world.allgather(survivors.whoami()))
        if len({host for host, _ in world.peers}) > 1:  # a peer's pid says nothing here
            world.pulses = survivors.Pulses(store)
        return cls.over(world)

    @classmethod
    def over(cls, world: StoreWorld):
        """The transport of ``world``'s ranks (whose ``peers`` are known): shared memory on
        one host; on several, TCP between them (the net transport; with hier where every
        host has as many ranks), or gloo (COMMLIB_CROSS=gloo)."""
        hosts = [host for host, _ in world.peers]
        if len(set(hosts)) == 1:
            return cls(world)
        even = len(set(Counter(hosts).values())) == 1
        color = sorted(set(hosts)).index(hosts[world.rank])
        if over_net(instead="gloo"):
            return HostsTransport(world, color, cls) if even else NetTransport(world)
        from . import load  # (the registry's: gloo's module imports this one)
        return load("gloo_hosts")(world, color) if even else load("gloo")(world)
