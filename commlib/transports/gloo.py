"""gloo: a communicator made from a store (torchrun) whose ranks are on several hosts.
There is no MPI library to join the hosts, so torch's gloo process group (TCP, under the
same store) does: each call's agreement is an all-gather of its descriptor there, and the
call runs as gloo's collective (commlib/algorithms/gloo.py). With as many ranks on every
host, GlooHostsTransport adds hier: shared memory inside each host, gloo between them.
"""
from __future__ import annotations

from datetime import timedelta

import numpy as np

from .. import _C
from ..errors import CommError, CommTimeoutError
from .base import Transport
from .hosts import HostLayout
from .store import StoreTransport, StoreWorld


class GlooTransport(Transport):
    name = "gloo"
    offers = frozenset({"gloo"})

    def __init__(self, world: StoreWorld):
        import torch.distributed as dist
        super().__init__(world)
        timeout = getattr(world.store, "timeout", None) or timedelta(minutes=30)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"{world.prefix}/gloo", world.store),
                                           world.rank, world.size, timeout)
        # a row per rank: the descriptor's 8 fields, then all_to_all's bytes per peer
        self._table = np.zeros((world.size, 8 + 2 * world.size), np.int64)
        self._mine = np.zeros(self._table.shape[1], np.int64)  # reused by every call
        self._sent = 0

    @staticmethod
    def suits(world) -> bool:
        return False  # made from a store (StoreTransport.create), never picked for MPI

    def wait(self, work, what: str = "its peers inside gloo's collective (gloo does not "
             "say which)") -> None:
        """Wait for gloo's ``work`` within the call's timeout; its failures as CommErrors."""
        try:
            work.wait(timedelta(seconds=self.timeout)) if self.timeout else work.wait()
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise CommTimeoutError(f"timed out after {self.timeout:g} s waiting for {what}"
                                       f" ({e})") from None
            raise CommError(f"gloo failed while waiting for {what}: {e}") from None

    def agree(self, desc, splits=None, itemsize=1) -> None:
        import torch
        mine = self._mine
        mine[:8] = desc
        if splits:
            mine[8:] = list(splits[0]) + list(splits[1])
        self.wait(self.group._allgather_base(torch.from_numpy(self._table).view(-1),
                                             torch.from_numpy(mine)),
                  "its peers to start the same collective")
        _C.check_agreement(self._table, itemsize, bool(splits))

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
    offers = frozenset({"hosts", "gloo"})

    def __init__(self, world: StoreWorld, color: int):
        super().__init__(world)
        self.join_hosts(world, color, StoreTransport, GlooTransport, "gloo")
