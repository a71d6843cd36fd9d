"""Who is still alive: the ranks of a store world (commlib/transports/store.py) that go on
after a peer died, agreed through the store.

Vocabulary: an *attempt* is one try at shrinking a world (a death during the try fails it
on every survivor, who then try again: attempt 2, 3, ...); a rank *posts* itself alive
under the attempt's key; a rank is *out* once its process is seen to have exited: on this
host by its pid, on another by its *pulse* (a counter in the store that a thread of every
process of a world spanning hosts raises every BEAT seconds) standing still for SILENT
seconds, as when its host is lost; else once the deadline passes without its post. Each
survivor waits until every rank has posted or is out, then offers its view to
the store: the first view offered is the one every rank takes (compare_set), so no two
survivors ever form different groups; a rank that finds itself left out raises.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

from . import _C
from .errors import CommError


BEAT, SILENT = 0.25, 1.0  # seconds


def gone(world, rank: int) -> bool:
    """Whether ``rank`` of ``world`` (whose ``peers`` are (host, pid)) is seen to have
    exited: its pid on this host, its pulse on another (where ``world.pulses`` watches)."""
    host, pid = world.peers[rank]
    if host == socket.gethostname():
        return not _C.process_alive(pid)  # (csrc/process.h)
    return world.pulses is not None and world.pulses.silent(host, pid)


class Pulses:
    """This process's pulse in ``store`` (a daemon thread raises it every BEAT seconds while
    the process lives), and what it has seen of its peers' pulses."""

    def __init__(self, store):
        self.store = store
        self.seen: dict = {}  # key: (value, since when)
        mine = self.key(socket.gethostname(), os.getpid())
        store.add(mine, 1)  # (present before any peer looks)
        threading.Thread(target=self._beat, args=(mine,), name="commlib-pulse",
                         daemon=True).start()

    @staticmethod
    def key(host: str, pid: int) -> str:
        return f"commlib/pulse/{host}:{pid}"

    def _beat(self, key: str) -> None:
        try:
            while True:
                time.sleep(BEAT)
                self.store.add(key, 1)
        except Exception:  # the store is gone (its host's process ended): nobody watches
            return

    def silent(self, host: str, pid: int) -> bool:
        """Whether the pulse of ``pid`` on ``host`` has stood still for SILENT seconds of
        this process's watching (False for a process that never had one)."""
        key = self.key(host, pid)
        if not self.store.check([key]):
            return False
        value, now = self.store.add(key, 0), time.monotonic()
        last = self.seen.get(key)
        if last is None or last[0] != value:
            self.seen[key] = (value, now)
            return False
        return now - last[1] > SILENT


def agree(world, attempt: int, timeout: float) -> list[int]:
    """The ranks of ``world`` (a StoreWorld) that go on, in rank order, the same list on
    every one of them; collective over the survivors. Ranks neither posted nor seen gone
    within ``timeout`` seconds are left out."""
    store, key = world.store, f"{world.prefix}/shrink{attempt}"
    store.set(f"{key}/alive/{world.rank}", str(os.getpid()))
    posted, undecided = {world.rank}, set(range(world.size)) - {world.rank}
    deadline, nap = time.monotonic() + timeout, 50e-6
    while undecided and time.monotonic() < deadline:
        for r in sorted(undecided):
            if store.check([f"{key}/alive/{r}"]):
                posted.add(r)
                undecided.discard(r)
            elif gone(world, r):
                undecided.discard(r)
        time.sleep(nap)
        nap = min(2 * nap, 5e-3)
    offered = json.dumps(sorted(posted))
    taken = json.loads(store.compare_set(f"{key}/members", "", offered))
    if world.rank not in taken:
        raise CommError(f"shrink: rank {world.rank} was left out by its peers (it did not "
                        f"post itself alive within {timeout:g} s of the first survivor); "
                        f"the survivors are ranks {taken}")
    return taken
