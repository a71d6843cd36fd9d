"""The MPI world the MPI-based transports (mpi, shm, hosts) share: how a communicator's ranks
met (an mpi4py communicator), which host each is on, and their point-to-point messages."""
from __future__ import annotations

import functools
import json
import os
from functools import cached_property

import numpy as np
from mpi4py import MPI

from .. import settings
from ..errors import CommError
from ..work import Deadline, RequestPoller, wait_request
from .base import affinity


class MpiWorld:
    """A communicator's ranks as an MPI communicator ``mpi`` (the user's), with private
    duplicates for collectives (``coll``) and point-to-point messages, so that neither
    meets the user's own MPI traffic nor the other. Counts what MPI moves for us."""

    offers = frozenset({"mpi"})

    def __init__(self, mpi_comm: MPI.Comm, owned: bool = False):
        self.mpi, self.owned = mpi_comm, owned  # owned: freed with this world
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.coll, self._p2p = mpi_comm.Dup(), mpi_comm.Dup()
        self._poller = RequestPoller(f"r{self.rank}of{self.size}")
        self.bytes_sent = 0  # by MPI's own collectives (the least any algorithm sends) and sends

    def allgather(self, value) -> list:
        """Every rank's JSON-able ``value``, in rank order (set-up facts)."""
        return allgather(self.coll, value)

    @property
    def members(self) -> tuple:
        """The MPI.COMM_WORLD ranks of this world's ranks, in rank order."""
        mine, world = self.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return tuple(MPI.Group.Translate_ranks(mine, list(range(self.size)), world))
        finally:
            mine.Free()
            world.Free()

    def count_sent(self, nbytes: float) -> None:
        self.bytes_sent += int(nbytes)

    @cached_property
    def hosts(self) -> tuple[int, bool]:
        """(hosts the ranks are on, whether each has as many), found at first ask: collective."""
        colors = allgather(self.coll, host_color(self.coll))
        return len(set(colors)), len({colors.count(c) for c in colors}) == 1

    def cores_each(self) -> float:
        return cores_each_on_host(self.coll)

    @cached_property
    def takes_device_memory(self) -> bool:
        """Whether MPI moves GPU memory itself: CUDA-aware, and not Open MPI (whose
        non-blocking collectives, ours, take no device memory)."""
        from .. import cuda
        return cuda.mpi_is_cuda_aware() and not _open_mpi()

    def split(self, color, key) -> "MpiWorld | None":
        """A world of the ranks with equal ``color``; its MPI communicator is freed with it."""
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MpiWorld(sub, owned=True)

    def dup(self) -> "MpiWorld":
        return MpiWorld(self.mpi.Dup(), owned=True)

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
                         f"rank {dst} to receive (send, tag {tag})", keep=keep, cancel=False)
        except MPI.Exception as e:
            raise CommError(f"send to rank {dst} failed inside MPI: {e}") from e
        return None

    def recv(self, buf, src: int | None, tag: int, deadline: Deadline, async_op: bool, keep):
        """Receive from ``src`` (None: any rank)."""
        peer = "any rank" if src is None else f"rank {src}"
        source = MPI.ANY_SOURCE if src is None else src
        try:
            if async_op:
                return self._poller.track(self._p2p.Irecv(buf.bytes, source, tag),
                                          f"recv from {peer}", keep,
                                          expect_bytes=buf.nbytes, deadline=deadline,
                                          keep=keep)
            status = MPI.Status()
            wait_request(self._p2p.Irecv(buf.bytes, source, tag), deadline,
                         f"{peer} to send (recv, tag {tag})", status, keep=keep)
        except MPI.Exception as e:
            raise CommError(f"recv from {peer} failed inside MPI (a message larger than "
                            f"the {buf.nbytes}-byte tensor?): {e}") from e
        got = status.Get_count(MPI.BYTE)
        if got != buf.nbytes:
            raise CommError(f"recv from rank {status.Get_source()}: got {got} bytes, tensor "
                            f"holds {buf.nbytes}")
        return keep

    def close(self) -> None:
        self._poller.close()
        for c in (self.coll, self._p2p, *((self.mpi,) if self.owned else ())):
            if c != MPI.COMM_NULL:
                c.Free()


@functools.lru_cache(maxsize=None)
def _open_mpi() -> bool:
    return "Open MPI" in MPI.Get_library_version()


def host_color(mpi_comm: MPI.Comm) -> int:
    """An id shared exactly by the ranks of ``mpi_comm`` on this rank's (virtual) host.
    COMMLIB_RANKS_PER_HOST=k pretends that world ranks [0, k), [k, 2k), ... are separate
    hosts, so the multi-host path can be tested on one machine."""
    per_host = settings.get("COMMLIB_RANKS_PER_HOST")
    if per_host:
        return MPI.COMM_WORLD.Get_rank() // per_host
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:  # the lowest world rank on the node names it
        lowest = np.array([MPI.COMM_WORLD.Get_rank()], np.int64)
        node.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
        return int(lowest[0])
    finally:
        node.Free()


def cores_each_on_host(mpi_comm: MPI.Comm) -> float:
    """The cores this machine's MPI processes may run on, over how many they are (under 1:
    they outnumber the cores). Collective over ``mpi_comm`` only (a subgroup's creation
    does not involve the other ranks). Its ranks on this machine share their affinities:
    where they all have the same cores (nothing bound them), the job's processes on this
    machine (the launcher says how many) share those cores; where a launcher bound them
    apart (Open MPI binds each to its own core), only this communicator's ranks are known
    to share the union."""
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = [frozenset(c) for c in allgather(node, affinity())]
        if len(set(cores)) == 1:
            return len(cores[0]) / max(node.Get_size(), _local_processes())
        return len(frozenset().union(*cores)) / node.Get_size()
    finally:
        node.Free()


def _local_processes() -> int:
    """How many processes of the job run on this machine, as the launcher says (MPICH's
    hydra, Open MPI); 0 if it does not."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def allgather(mpi_comm: MPI.Comm, value) -> list:
    """Every rank's JSON-able ``value``, in rank order (tuples come back as lists): as JSON,
    since mpi4py's lowercase allgather would unpickle whatever a peer sends."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.empty(mpi_comm.Get_size(), np.int64)
    mpi_comm.Allgather(np.array([data.size], np.int64), lengths)
    gathered = np.empty(int(lengths.sum()), np.uint8)
    mpi_comm.Allgatherv(data, [gathered, lengths])
    ends = np.cumsum(lengths)
    return [json.loads(gathered[end - n:end].tobytes()) for n, end in zip(lengths, ends)]

