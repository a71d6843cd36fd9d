"""Who is still alive: the ranks of a store world (commlib/transports/store.py) that go on
after a peer died, agreed through the store.

Vocabulary: an *attempt* is one try at shrinking a world (a death during the try fails it
on every survivor, who then try again: attempt 2, 3, ...); a rank *posts* itself alive
under the attempt's key; a rank is *out* once its process is seen to have exited (on this
host) or, where that cannot be seen (another host), once the deadline passes without its
post. Each survivor waits until every rank has posted or is out, then offers its view to
the store: the first view offered is the one every rank takes (compare_set), so no two
survivors ever form different groups; a rank that finds itself left out raises.
"""
from __future__ import annotations

import json
import os
import socket
import time

from . import _C
from .errors import CommError


def gone(peers, rank: int) -> bool:
    """Whether ``rank`` of a world whose ``peers`` are (host, pid) is seen to have exited."""
    host, pid = peers[rank]
    return host == socket.gethostname() and not _C.process_alive(pid)  # (csrc/process.h)


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
            elif gone(world.peers, r):
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
