"""torchft's reconfigurable process group over commlib: torchft's Manager reconfigures it
at every quorum change (``configure``: the old group aborted, a new one formed through the
store torchft hands it, among the replicas of the new quorum), so Fault Tolerant DDP,
HSDP, LocalSGD and DiLoCo run their cross-replica traffic on commlib.

    from commlib.torch.ft import ProcessGroupCommlibFT
    manager = torchft.Manager(pg=ProcessGroupCommlibFT(), ...)

Needs the ``ft`` extra (torchft). The replicas of one quorum share memory where they share
a host, and TCP joins them across hosts (Communicator.from_store).
"""
from __future__ import annotations

from torchft.process_group import ProcessGroupWrapper

from ..comm import Communicator
from .backend import ProcessGroupCommlib


class ProcessGroupCommlibFT(ProcessGroupWrapper):
    """A torchft ProcessGroupWrapper whose groups are commlib's (backend.py's)."""

    def _create_pg(self, store, rank: int, world_size: int) -> ProcessGroupCommlib:
        comm = Communicator.from_store(store, rank, world_size, "commlib/ft")
        return ProcessGroupCommlib(comm, "torchft", self._timeout)

    def getBackendName(self) -> str:
        return "torchft-commlib"
