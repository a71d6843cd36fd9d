"""mpi: every rank through MPI (mpi4py). Schedules run on the Python executor
(commlib/executors/python.py); MPI's own collectives (native) run on the same private
communicator. Also the MPI world the other MPI-based transports share: how ranks met, and
their point-to-point messages.

Unless COMMLIB_CHECK=0, the ranks agree on every call before it moves data: each sends its
descriptor (and all_to_all's splits) to every other, then all raise
CollectiveMismatchError alike if they differ.
"""
from __future__ import annotations

import functools
import os
from functools import cached_property

import numpy as np
from mpi4py import MPI

from .. import _C
from ..call import NONE, descriptor
from ..errors import CommError
from ..exchange import MpiGroup, allgather
from ..executors.python import PythonExecutor
from ..work import Deadline, RequestPoller, wait_all_requests, wait_request
from .base import Transport, affinity

AGREEMENT_TAG = 6  # on the collective communicator; the mpi4py executor uses 7


class MpiWorld:
    """A communicator's ranks as an MPI communicator ``mpi`` (the user's), with private
    duplicates for collectives (``coll``) and point-to-point messages, so that neither
    meets the user's own MPI traffic nor the other. Counts what MPI moves for us."""

    offers = frozenset({"mpi"})

    def __init__(self, mpi_comm: MPI.Comm, owned: bool = False):
        self.mpi, self.owned = mpi_comm, owned  # owned: freed with this world
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.coll, self._p2p = mpi_comm.Dup(), mpi_comm.Dup()
        self.group = MpiGroup(self.coll)
        self._poller = RequestPoller(f"r{self.rank}of{self.size}")
        self.bytes_sent = 0  # by MPI's own collectives (the least any algorithm sends) and sends

    def count_sent(self, nbytes: float) -> None:
        self.bytes_sent += int(nbytes)

    def topology(self) -> "Topology":
        return Topology(self.coll)

    def crowded(self) -> bool:
        return crowded_host()

    @cached_property
    def takes_device_memory(self) -> bool:
        """Whether MPI moves GPU memory itself: a CUDA-aware MPI, other than Open MPI,
        whose non-blocking collectives (ours, so that they time out) take no device
        memory."""
        from .. import cuda
        return cuda.mpi_is_cuda_aware() and not _open_mpi()

    def split(self, color, key) -> "MpiWorld | None":
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MpiWorld(sub)

    def dup(self) -> "MpiWorld":
        return MpiWorld(self.mpi.Dup())

    def make_transport(self):
        from . import pick
        return pick(self)

    # point to point: posted at once on the caller's thread (so that paired sends and
    # receives never deadlock), completed by the poller's thread when async
    def send(self, buf, dst: int, tag: int, deadline: Deadline, async_op: bool, keep):
        self.count_sent(buf.nbytes)
        try:
            if async_op:
                return self._poller.track(self._p2p.Isend(buf.bytes, dst, tag),
                                          f"send to rank {dst}", None, deadline=deadline,
                                          keep=keep)
            wait_request(self._p2p.Isend(buf.bytes, dst, tag), deadline,
                         f"rank {dst} to receive (send, tag {tag})", keep=keep)
        except MPI.Exception as e:
            raise CommError(f"send to rank {dst} failed inside MPI: {e}") from e
        return None

    def recv(self, buf, src: int, tag: int, deadline: Deadline, async_op: bool, keep):
        try:
            if async_op:
                return self._poller.track(self._p2p.Irecv(buf.bytes, src, tag),
                                          f"recv from rank {src}", keep,
                                          expect_bytes=buf.nbytes, deadline=deadline,
                                          keep=keep)
            status = MPI.Status()
            wait_request(self._p2p.Irecv(buf.bytes, src, tag), deadline,
                         f"rank {src} to send (recv, tag {tag})", status, keep=keep)
        except MPI.Exception as e:
            raise CommError(f"recv from rank {src} failed inside MPI (a message larger than "
                            f"the {buf.nbytes}-byte tensor?): {e}") from e
        got = status.Get_count(MPI.BYTE)
        if got != buf.nbytes:
            raise CommError(f"recv from rank {src}: got {got} bytes, tensor holds {buf.nbytes}")
        return keep

    def close(self) -> None:
        self._poller.close()
        for c in (self.coll, self._p2p, *((self.mpi,) if self.owned else ())):
            if c != MPI.COMM_NULL:
                c.Free()


@functools.lru_cache(maxsize=None)
def _open_mpi() -> bool:
    return "Open MPI" in MPI.Get_library_version()


class Topology:
    """How a communicator's ranks lie on hosts, found when first asked (collective)."""

    def __init__(self, coll: MPI.Comm):
        self._coll = coll

    @cached_property
    def _counted(self) -> tuple[int, bool]:
        colors = allgather(self._coll, host_color(self._coll))
        return len(set(colors)), len({colors.count(c) for c in colors}) == 1

    @property
    def hosts(self) -> int:
        return self._counted[0]

    @property
    def even(self) -> bool:
        """Whether every host has the same number of ranks."""
        return self._counted[1]


def host_color(mpi_comm: MPI.Comm) -> int:
    """An id shared exactly by the ranks of ``mpi_comm`` on this rank's (virtual) host.
    COMMLIB_RANKS_PER_HOST=k pretends that world ranks [0, k), [k, 2k), ... are separate
    hosts, so the multi-host path can be tested on one machine."""
    per_host = os.environ.get("COMMLIB_RANKS_PER_HOST")
    if per_host:
        if not per_host.isdigit() or int(per_host) < 1:
            raise ValueError(f"COMMLIB_RANKS_PER_HOST={per_host!r}; expected a positive int")
        return MPI.COMM_WORLD.Get_rank() // int(per_host)
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:  # the lowest world rank on the node names it
        lowest = np.array([MPI.COMM_WORLD.Get_rank()], np.int64)
        node.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
        return int(lowest[0])
    finally:
        node.Free()


@functools.lru_cache(maxsize=1)
def crowded_host() -> bool:
    """Whether this machine's MPI processes (all of them, whatever communicator or virtual
    hosts) outnumber the cores they may run on: the union of their affinities, since a
    launcher that binds each rank to its own core (Open MPI does) leaves each one core."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = set().union(*allgather(node, affinity()))
        return node.Get_size() > len(cores)
    finally:
        node.Free()


class Agreement:
    """Checks that every rank of an MPI communicator makes the same call: each sends its
    descriptor (and all_to_all's splits) to every other. Point to point rather than one
    allgather so that a timeout can name the ranks that never arrived. Calls on a
    communicator run one at a time, so one table and one set of persistent requests serve
    them all (starting those costs far less than posting new ones)."""

    def __init__(self, mpi_comm):
        size, me = mpi_comm.Get_size(), mpi_comm.Get_rank()
        # one message size for every call: a row is 8 fields, then bytes sent and
        # received per peer (all_to_all only); no message is ever truncated
        self.table = np.zeros((size, 8 + 2 * size), np.int64)
        self.mine = self.table[me]
        peers = [p for p in range(size) if p != me]
        self.requests = ([mpi_comm.Recv_init(self.table[p], p, AGREEMENT_TAG) for p in peers]
                         + [mpi_comm.Send_init(self.mine, p, AGREEMENT_TAG) for p in peers])
        self.peers = [f"rank {p}" for p in peers] * 2

    def check(self, desc: list, itemsize: int, splits=None, timeout=0.0) -> None:
        self.mine[:8] = desc
        if splits:
            self.mine[8:] = list(splits[0]) + list(splits[1])
        MPI.Prequest.Startall(self.requests)
        if not MPI.Request.Testall(self.requests):
            wait_all_requests(self.requests, self.peers, Deadline(timeout),
                              "to start the same collective", keep=self.table)
        _C.check_agreement(self.table, itemsize, bool(splits))

    def free(self) -> None:
        for request in self.requests:
            if request and not request.Test():  # abandoned after a timeout: MPI keeps it
                continue
            request.Free()


class MpiTransport(Transport):
    name = "mpi"
    offers = frozenset({"mpi"})

    def __init__(self, world: MpiWorld):
        super().__init__(world)
        self.executor = PythonExecutor(world.coll)
        self._check = os.environ.get("COMMLIB_CHECK", "1") != "0"
        self.agreement = Agreement(world.coll) if self._check else None

    @staticmethod
    def suits(topology) -> bool:
        return True

    @property
    def checks_calls(self) -> bool:
        return self._check

    def agree(self, desc, splits=None, itemsize=1) -> None:
        self.agreement.check(desc, itemsize, splits, self.timeout)

    def agree_call(self, call, algo) -> None:
        if self._check:
            super().agree_call(call, algo)

    def barrier(self) -> None:
        if self._check:  # the agreement's exchange is a barrier too
            self.agree(descriptor("barrier", "native", 0, NONE, NONE, NONE))
        else:
            wait_request(self.world.coll.Ibarrier(), Deadline(self.timeout),
                         "its peers to arrive")

    def plan(self, algo, call):
        return self.executor.plan(algo, self.size, self.rank, call.count, call.dtype.itemsize,
                                  call.params)

    def run_plan(self, plan, call) -> None:
        self.executor.run(plan, call.bufs, call.dtype.code, call.op_code)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds
        self.executor.set_timeout(seconds)

    def device_offers(self) -> frozenset:
        return frozenset({"cuda_mpi"}) if self.world.takes_device_memory else frozenset()

    @property
    def bytes_sent(self) -> int:
        return self.executor.bytes_sent + self.world.bytes_sent

    def close(self) -> None:
        if self.agreement is not None:
            self.agreement.free()
        super().close()
