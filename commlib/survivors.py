"""Who is still alive: the ranks of a store world (commlib/transports/store.py) that go on
after a peer died, agreed through the store.

Vocabulary: an *attempt* is one try at shrinking a world (a death during the try fails it
on every survivor, who then try again: attempt 2, 3, ...); a rank *posts* itself alive
under the attempt's key; a rank is *out* once its process is seen to have exited: on this
host by its pid, on another by its *pulse* (a counter in the store that every process of
a world spanning hosts raises every BEAT seconds, from one thread whatever its worlds:
_Heart) standing still for SILENT seconds, as when its host is lost or cut off; else once
the deadline passes without its post. Each survivor waits until every rank has posted or
is out, then offers its view to the store: the first view offered is the one every rank
takes (compare_set), so no two survivors ever form different groups; a rank that finds
itself left out raises.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import weakref

from . import _C, settings
from .errors import CommError


BEAT, SILENT = 0.25, 1.0  # seconds


def whoami() -> tuple[str, int]:
    """This process as its peers know it: (host, pid). The host is COMMLIB_HOSTID where set
    (processes with the same one share memory; as NCCL_HOSTID, for containers that share a
    hostname across machines), else the hostname."""
    return settings.get("COMMLIB_HOSTID") or socket.gethostname(), os.getpid()


def gone(world, rank: int) -> bool:
    """Whether ``rank`` of ``world`` (whose ``peers`` are (host, pid)) is seen to have
    exited: its pid on this host, its pulse on another (where ``world.pulses`` watches)."""
    host, pid = world.peers[rank]
    if host == whoami()[0]:
        return not _C.process_alive(pid)  # (csrc/process.h)
    return world.pulses is not None and world.pulses.silent(host, pid)


class Pulses:
    """The pulses of a world's peers in ``store``; watching them makes this process beat
    there too."""

    def __init__(self, store):
        self.store = store
        _HEART.beat_in(store)

    @staticmethod
    def key(host: str, pid: int) -> str:
        return f"commlib/pulse/{host}:{pid}"

    def silent(self, host: str, pid: int) -> bool:
        """Whether the pulse of ``pid`` on ``host`` has stood still for SILENT seconds since
        this process first asked (False for a process that never had one). CommError where
        this process has not reached the store itself for SILENT seconds."""
        return _HEART.silent(self.store, self.key(host, pid))

    def watch(self, owner, peers: dict, lost) -> None:
        """Call ``lost(why)`` from the pulse thread, once, when a pulse of ``peers`` (rank
        -> (host, pid)) has stood still for SILENT seconds or this process cannot reach
        the store: for waits that cannot ask themselves (the net transport's, in C++).
        Until ``unwatch(owner)``, or ``owner`` is gone."""
        keys = {r: (host, pid, self.key(host, pid)) for r, (host, pid) in peers.items()}
        with _HEART.lock:
            _HEART.watchers[owner] = (self.store, keys, lost)

    @staticmethod
    def unwatch(owner) -> None:
        with _HEART.lock:
            _HEART.watchers.pop(owner, None)


class _Heart:
    """This process's one pulse thread. Every BEAT seconds it raises the process's counter
    in every store it was given (while that store lives), and reads there the counters that
    waits asked about lately; the waits read what it saw, never the store itself (a store
    out of reach would hold them). One thread, whatever the worlds: the torch backend
    makes one per process group."""

    FORGET = 5.0  # seconds: a pulse nobody asked about for this long is no longer read

    def __init__(self):
        self.lock = threading.Lock()
        self.reached = weakref.WeakKeyDictionary()  # store -> when a beat there went through
        self.watched = weakref.WeakKeyDictionary()  # store -> {key: [value, since, asked]}
        self.watchers = weakref.WeakKeyDictionary()  # owner -> (store, peers' keys, lost)
        self.thread = None
        self.stopping = threading.Event()
        # (a daemon thread still inside the store's C++ when the interpreter finalizes is
        # unwound through frames that cannot be: "terminate called without an active
        # exception", the process aborted after its work was done)
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the pulse thread (at exit, before the interpreter finalizes)."""
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * BEAT + 1.0)

    def beat_in(self, store) -> None:
        key = Pulses.key(*whoami())
        store.add(key, 1)  # (present before any peer looks)
        with self.lock:
            self.reached[store] = time.monotonic()
            self.watched.setdefault(store, {})
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._beat, args=(key,),
                                               name="commlib-pulse", daemon=True)
                self.thread.start()

    def silent(self, store, key: str) -> bool:
        now = time.monotonic()
        with self.lock:
            if now - self.reached.get(store, now) > SILENT:
                raise CommError(f"this process has not reached the store for {SILENT:g} s: "
                                "its host is cut off from its peers (or the store's is lost)")
            pulse = self.watched[store].setdefault(key, [None, now, now])
            pulse[2] = now
            return pulse[0] is not None and now - pulse[1] > SILENT

    def _beat(self, key: str) -> None:
        while not self.stopping.wait(BEAT):
            with self.lock:
                stores = [(store, list(pulses)) for store, pulses in self.watched.items()]
            for store, keys in stores:
                try:
                    store.add(key, 1)
                    seen = {k: store.add(k, 0) for k in keys if store.check([k])}
                except Exception:  # out of reach, or gone with its host's process
                    continue
                now = time.monotonic()
                with self.lock:
                    self.reached[store] = now
                    pulses = self.watched.get(store, {})
                    for k, value in seen.items():
                        if k in pulses and pulses[k][0] != value:
                            pulses[k][:2] = value, now
                    for k in [k for k, p in pulses.items() if now - p[2] > self.FORGET]:
                        del pulses[k]
            self._alert()

    def _alert(self) -> None:
        """Tell each watcher whose peer's pulse stood still (Pulses.watch), once."""
        with self.lock:
            watching = list(self.watchers.items())
        for owner, (store, keys, lost) in watching:
            try:
                quiet = [(r, host, pid) for r, (host, pid, k) in keys.items()
                         if self.silent(store, k)]
                if not quiet:
                    continue
                why = ", ".join(f"rank {r} (pid {pid} on {host})" for r, host, pid in quiet) + \
                    (f" exited (on another host: its pulse stood still for {SILENT:g} s: the "
                     "host lost or cut off)")
            except CommError as e:  # this process is the one cut off
                why = str(e)
            with self.lock:
                self.watchers.pop(owner, None)
            lost(why)


_HEART = _Heart()  # (per process: a fork's child starts its own thread on first use)


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
