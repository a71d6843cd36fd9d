"""Set-up facts exchanged between ranks over MPI as JSON: mpi4py's lowercase allgather
and bcast would unpickle whatever a peer sends, which can run arbitrary code."""
from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI


def allgather(mpi_comm: MPI.Comm, value) -> list:
    """Every rank's JSON-able ``value``, in rank order (tuples come back as lists)."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.empty(mpi_comm.Get_size(), np.int64)
    mpi_comm.Allgather(np.array([data.size], np.int64), lengths)
    gathered = np.empty(int(lengths.sum()), np.uint8)
    mpi_comm.Allgatherv(data, [gathered, lengths])
    ends = np.cumsum(lengths)
    return [json.loads(gathered[end - n:end].tobytes()) for n, end in zip(lengths, ends)]


class MpiGroup:
    """An MPI communicator as a group with a JSON ``allgather`` (like store.StoreGroup)."""

    def __init__(self, mpi_comm: MPI.Comm):
        self.mpi, self.rank, self.size = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()

    def allgather(self, value) -> list:
        return allgather(self.mpi, value)
