"""Communicators without MPI: the processes of one host meet through a key-value store.

torchrun starts processes that are each alone in their MPI world, but hands them a store
(torch.distributed's TCPStore). That is enough to set up the shared-memory transport: the
segment names are exchanged through the store instead of MPI, and every collective then
runs on shared memory as under mpiexec. Point-to-point messages travel through the store
itself: correct (MPI's order per source and tag is kept) but slow, since every byte
crosses the store's server; launch with mpiexec where send/recv speed matters.

Values put in the store are JSON (set-up facts) or raw bytes (messages): nothing received
from a peer is unpickled.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from datetime import timedelta

from .errors import CommError
from .hosts import affinity


def wait_get(store, key: str, what: str) -> bytes:
    """``store.get(key)`` once the key exists, within the store's timeout. Polled, because
    a blocking get would hold the store's one connection and stall every other thread's
    use of it (a send cannot go out while a receive waits)."""
    timeout = getattr(store, "timeout", timedelta(minutes=5)).total_seconds()
    deadline, nap = time.monotonic() + timeout, 50e-6
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise CommError(f"{what}: nothing arrived within the store's timeout "
                            f"({timeout:.0f} s; key {key!r})")
        time.sleep(nap)
        nap = min(2 * nap, 5e-3)
    return store.get(key)


class StoreGroup:
    """``rank`` of ``size`` processes sharing ``store`` under the key ``prefix``; every
    member must make the same sequence of calls."""

    def __init__(self, store, rank: int, size: int, prefix: str):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self.store, self.rank, self.size, self.prefix = store, rank, size, prefix
        self.rounds = 0  # allgathers so far: names each one's keys

    def allgather(self, value) -> list:
        """Every member's JSON-able ``value``, in rank order."""
        self.rounds += 1
        key = f"{self.prefix}/gather{self.rounds}"
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        return [json.loads(wait_get(self.store, f"{key}/{r}", f"set-up waiting for rank {r} "
                                    "(did every process of the group start?)"))
                for r in range(self.size)]


def check_one_host(group: StoreGroup) -> None:
    hosts = group.allgather(socket.gethostname())
    if len(set(hosts)) > 1:
        raise CommError(f"a communicator made from a store needs all its ranks on one host "
                        f"(shared memory); these are on {sorted(set(hosts))}. Launch with "
                        "mpiexec to run across hosts")


def crowded(group: StoreGroup) -> bool:
    """Whether the group's processes outnumber the cores they may run on (see
    hosts.crowded_host; here the group is all that is known of the machine)."""
    return group.size > len(set().union(*group.allgather(affinity())))


class StoreMailbox:
    """send/recv of bytes through the store. A message is one key, numbered per (source,
    destination, tag) in the order the sends and receives are issued, so messages with one
    tag arrive in order and different tags do not block each other; the receiver deletes
    it. Sends complete at once (the store holds the bytes)."""

    def __init__(self, store, rank: int, prefix: str):
        self.store, self.rank, self.prefix = store, rank, prefix
        self._sent: Counter = Counter()
        self._posted: Counter = Counter()
        self._lock = threading.Lock()

    def _key(self, src: int, dst: int, tag: int, counter: Counter) -> str:
        with self._lock:  # sends and receives may be issued from several threads
            seq = counter[(src, dst, tag)]
            counter[(src, dst, tag)] = seq + 1
        return f"{self.prefix}/{src}->{dst}/{tag}/{seq}"

    def send(self, data: bytes, dst: int, tag: int) -> None:
        self.store.set(self._key(self.rank, dst, tag, self._sent), data)

    def post_recv(self, src: int, tag: int):
        """Claim the next message from ``src`` with ``tag`` now (so receives match in the
        order issued); the returned function blocks until it is there and returns it."""
        key = self._key(src, self.rank, tag, self._posted)

        def receive() -> bytes:
            data = wait_get(self.store, key, f"recv from rank {src} (tag {tag})")
            self.store.delete_key(key)
            return data
        return receive
