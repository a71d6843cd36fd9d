"""Communicator.register: GPU memory that every peer of the host maps once, so that an
all_reduce on it (or on any part of it) needs no copy through our slots (cuda/ipc.py,
"registered"). Like ncclCommRegister: worth it for buffers used again and again (gradient
buckets, activations), as registering costs a collective and a CUDA IPC mapping per peer.
"""
from __future__ import annotations

from ..buffers import as_buffer
from ..calls import NONE, check_timeout, descriptor
from ..errors import CommError
from . import ipc


class RegisteredMemory:
    """What Communicator.register returns. ``close()`` (collective, like register) unmaps it
    on every rank, after the calls before it; so does leaving a ``with`` block."""

    def __init__(self, comm, gpu, registration, array):
        self._comm, self._gpu, self.registration = comm, gpu, registration
        self._array = array  # kept alive while the peers map it

    def close(self) -> None:
        if self._gpu is None:
            return
        comm, gpu, registration = self._comm, self._gpu, self.registration
        self._gpu = self._array = None
        comm._engine.run("deregister", lambda: gpu.deregister(comm._executor.group, registration),
                         async_op=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._gpu is None else f"{self.registration.nbytes} bytes"
        return f"<RegisteredMemory #{self.registration.index} {state}>"


def register(comm, t, timeout=None) -> RegisteredMemory:
    """Share ``t``'s GPU memory with the communicator's peers (every rank calls it, each
    with its own array, in the same order). all_reduce calls on ``t`` or a part of it,
    made on every rank with registered memory, then read and write the peers' buffers
    directly."""
    buf = as_buffer(t, "t")
    if buf.device is None:
        raise TypeError("register: t is in host memory; only CUDA arrays are registered "
                        "(host memory needs no registration)")
    if not ipc.usable(comm, buf):
        raise ValueError(f"register: needs 2 to {ipc.MAX_RANKS} ranks of one host sharing "
                         "memory (the shm transport), and COMMLIB_CUDA_IPC not 0")
    seconds = comm.timeout if timeout is None else check_timeout(timeout)
    desc = descriptor("all_reduce", "register", 0, NONE, NONE, NONE)
    gpu = comm.staging.ipc(comm, buf.device.device, desc, 1, seconds)
    if gpu is None:
        raise CommError(f"register: CUDA IPC is unavailable here: "
                        f"{comm.staging.ipc_problem(buf.device.device)}")
    made = []

    def body():
        comm._executor.set_timeout(seconds)
        comm._executor.transport.agree(desc, [], [], 1)
        try:
            made.append(gpu.register(comm._executor.group, buf.ptr, buf.nbytes))
        except RuntimeError as e:
            raise CommError(f"register: {e}") from None
    comm._engine.run("register", body, async_op=False)
    return RegisteredMemory(comm, gpu, made[0], t)
