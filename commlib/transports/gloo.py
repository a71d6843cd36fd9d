"""gloo: a communicator made from a store (torchrun) whose ranks are on several hosts,
with COMMLIB_CROSS=gloo (by default the net transport joins them): torch's gloo process
group (TCP, under the same store) does: each call's agreement is an all-gather of its
descriptor there, and the call runs as gloo's collective (commlib/algorithms/gloo.py), or,
when small, rides in that all-gather (eager). With as many ranks on every host,
GlooHostsTransport adds hier: shared memory inside each host, gloo between them.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import replace
from datetime import timedelta

import numpy as np

from .. import _C, settings, survivors
from ..collectives import of as collective_of
from ..errors import CommError, CommTimeoutError
from . import rows
from .base import Transport
from .hosts import HostLayout
from .store import StoreTransport, StoreWorld


class GlooTransport(Transport):
    name = "gloo"
    offers = frozenset({"gloo", "eager"})

    def __init__(self, world: StoreWorld):
        import torch.distributed as dist
        super().__init__(world)
        timeout = getattr(world.store, "timeout", None) or timedelta(minutes=30)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"{world.prefix}/gloo", world.store),
                                           world.rank, world.size, timeout)
        # a row per rank (transports/rows.py); every agreement sends a whole row
        self.header = rows.header_words(world.size)
        self._table = np.zeros((world.size, rows.gloo_row_bytes(world.size) // 8), np.int64)
        self._mine = np.zeros(self._table.shape[1], np.int64)  # reused by every call
        self._sent = 0
        # COMMLIB_CHECK=0: gloo's collectives unchecked, as over MPI (ranks that disagree
        # then meet gloo's own failures: it aborts the process on mismatched lengths)
        self.checks_calls = settings.get("COMMLIB_CHECK")
        self.where = replace(self.where, checked=self.checks_calls)
        self._in_flight = None  # gloo's work being waited for
        self._interrupted = False

    @staticmethod
    def suits(world) -> bool:
        return False  # made from a store (StoreTransport.create), never picked for MPI

    def wait(self, work, what: str = "its peers inside gloo's collective (gloo does not "
             "say which)") -> None:
        """Wait for gloo's ``work`` within the call's timeout, its failures as CommErrors.
        gloo itself waits for a peer until its own timeout; here the wait is cut into
        slices, between which a rank whose process is gone (on another host: its pulse
        stood still, as when the host is lost or cut off) or ``interrupt`` fails the call
        at once."""
        self._in_flight = work
        deadline = time.monotonic() + self.timeout if self.timeout else None
        while True:
            try:
                work.wait(timedelta(seconds=survivors.BEAT))
                break
            except RuntimeError as e:
                if work.is_completed():  # gloo's own failure, not the slice's end
                    self._in_flight = None
                    if "timed out" in str(e).lower():
                        raise CommTimeoutError(f"gloo timed out waiting for {what} ({e})") \
                            from None
                    raise CommError(f"gloo failed while waiting for {what}: {e}") from None
            if self._interrupted:
                raise CommError(f"rank {self.rank} aborted the communicator "
                                "(Communicator.abort) during a call over gloo")
            gone = [r for r in range(self.size) if r != self.rank and self._gone(r)]
            if gone:
                raise CommError(f"{what}: {', '.join(self.world.who(r) for r in gone)} "
                                f"exited (on another host: its pulse stood still for "
                                f"{survivors.SILENT:g} s: the host lost or cut off)")
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeoutError(f"timed out after {self.timeout:g} s waiting for {what}")
        self._in_flight = None

    def _gone(self, r: int) -> bool:
        try:
            return survivors.gone(self.world, r)
        except Exception as e:  # the store is unreachable: this host is the one cut off
            raise CommError(f"gloo's call: the store is unreachable ({e}); this rank may be "
                            "the one cut off from its peers") from None

    def interrupt(self) -> None:
        self._interrupted = True  # (the wait's next slice sees it)
        super().interrupt()  # (hier's parts)

    def close(self) -> None:
        """Release gloo's group, unless a call is still in flight there (interrupted, or its
        peer lost): then its destructor would wait for that call, until gloo's own timeout,
        so the group is kept, unreachable, for the rest of the process."""
        if self._in_flight is not None and not self._in_flight.is_completed():
            _keep_forever(self.group)
        self.group = None
        super().close()

    def agree(self, desc, splits=None, itemsize=1) -> None:
        self._mine[:8] = desc
        if splits:
            self._mine[8:self.header] = list(splits[0]) + list(splits[1])
        self._exchange(itemsize, bool(splits))

    def _exchange(self, itemsize: int, splits: bool) -> None:
        """Every rank's row into the table (one all-gather), then checked."""
        import torch
        self.wait(self.group._allgather_base(torch.from_numpy(self._table).view(-1),
                                             torch.from_numpy(self._mine)),
                  "its peers to start the same collective")
        _C.check_agreement(self._table[:, :self.header], itemsize, splits)

    def eager(self, call) -> None:
        """An eager collective (algorithms/eager.py): the data ride in this rank's row; the
        result comes from every rank's row, reduced in rank order."""
        n, collective, out = self.size, call.collective, call.out
        kind = collective_of(collective)
        data = call.inp if kind.has_input else out
        sent = data.nbytes if not kind.from_root or self.rank == call.root else 0
        most = rows.gloo_payload_bytes(n)
        if sent > most:  # (select.py refuses such calls before they start)
            raise ValueError(f"eager sends at most {most} bytes here")
        self._mine[:8] = call.descriptor("eager")
        _C.copy(self._mine.ctypes.data + 8 * self.header, data.ptr, sent)
        self._exchange(call.dtype.itemsize, False)
        table = self._table
        root = _C.NONE if call.root is None else call.root
        _C.eager_result(_C.COLLECTIVES[collective], self.rank, n, root,
                        table.ctypes.data + 8 * self.header, table.strides[0], sent, out.ptr,
                        out.numel, call.dtype.code, call.op_code)

    def barrier(self) -> None:
        self.wait(self.group.barrier(), "its peers to arrive")

    def count_sent(self, nbytes: float) -> None:
        self._sent += int(nbytes)

    @property
    def bytes_sent(self) -> int:
        return self._sent + self.world.bytes_sent


class GlooHostsTransport(HostLayout, GlooTransport):
    """As many ranks on every host: hier over shared memory inside hosts, gloo between."""
    name = "hosts"
    offers = frozenset({"hosts", "gloo", "eager"})

    def __init__(self, world: StoreWorld, color: int):
        super().__init__(world)
        self.join_hosts(world, color, StoreTransport, GlooTransport, "gloo")


def _keep_forever(obj) -> None:
    """Never free ``obj``: one more reference that nothing will drop (a list would be
    cleared at the interpreter's exit, and the destructor then run)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
