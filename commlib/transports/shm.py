"""shm: the ranks of one host, over shared memory (csrc/shm.h, set up by
commlib/executors/shm.py). Schedules run on the shared-memory executor and the direct
collectives in C++; both publish every call's descriptor with it, so the ranks agree on
each call without a message of its own. MPI's own collectives run beside them where the
world is MPI's, and meet here first. Calls on numpy arrays take a C++ fast path
(commlib/fast_path.py) unless COMMLIB_FAST_PATH=0.
"""
from __future__ import annotations

import os

from .. import _C
from ..algorithms import Where
from ..call import NONE
from ..executors.shm import ShmExecutor
from .base import Transport


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, world):
        super().__init__(world)
        self.executor = ShmExecutor(world.group, world.crowded())
        self.shm = self.executor.transport  # the C++ ShmComm
        self.offers = frozenset({"shm", *world.offers})
        self.where = Where(self.name, staging_bytes=self.shm.staging_bytes)

    @staticmethod
    def suits(topology) -> bool:
        return topology.hosts == 1

    def agree(self, desc, splits=None, itemsize=1) -> None:
        self.shm.agree(desc, *(splits or ([], [])), itemsize)

    def agree_call(self, call, algo) -> None:
        if algo.build is None and algo.needs != "shm":  # its plans and direct ops check
            super().agree_call(call, algo)

    def barrier(self) -> None:
        self.shm.barrier()

    def plan(self, algo, call):
        return self.executor.plan(algo, self.size, self.rank, call.count, call.dtype.itemsize,
                                  call.params)

    def run_plan(self, plan, call) -> None:
        self.executor.run(plan, call.bufs, call.dtype.code, call.op_code)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = seconds
        self.executor.set_timeout(seconds)

    def direct(self, call) -> None:
        """The call's direct collective (csrc/shm_direct.cpp)."""
        inp = call.inp.ptr if call.inp is not None else 0
        self.shm.direct(_C.COLLECTIVES[call.collective], call.out.ptr, inp, call.count,
                        call.dtype.code, call.op_code, NONE if call.root is None else call.root,
                        *(call.splits or ((), ())))

    def all_reduce_phase(self, call, phase: int) -> None:
        """The direct all_reduce's reduce-scatter (1) or all-gather (2) alone (hier)."""
        self.shm.all_reduce(call.out.ptr, call.out.numel, call.dtype.code, call.op_code, phase)

    def fast_path(self, **kwargs):
        if os.environ.get("COMMLIB_FAST_PATH", "1") == "0":
            return None
        return _C.FastPath(self.shm, **kwargs)

    def device_offers(self) -> frozenset:
        from . import load
        ipc = {"cuda_ipc"} if load("cuda_ipc").suits(self) else set()
        return frozenset(ipc | ({"cuda_mpi"} if self.world.takes_device_memory else set()))

    @property
    def bytes_sent(self) -> int:
        return self.shm.bytes_sent + self.world.bytes_sent

    def close(self) -> None:
        super().close()
        self.executor = self.shm = None  # unmaps the segments
