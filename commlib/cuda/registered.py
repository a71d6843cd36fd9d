"""Communicator.register: GPU memory that every peer of the host maps once, so that a
collective whose input lies in it at every rank needs no copy through the IPC slots
(commlib/transports/cuda_ipc.py, "zero-copy"). Like ncclCommRegister: worth it for buffers
used again and again (gradient buckets, activations), as registering costs a collective
and a CUDA IPC mapping per peer.
"""
from __future__ import annotations

from typing import NamedTuple

from ..buffers import as_buffer
from ..call import NONE, check_timeout, descriptor
from ..errors import CommError
from .kernel_names import MAX_POINTERS


class Registration(NamedTuple):
    """Memory that every rank registered, as this rank sees it."""
    index: int  # the same registration on every rank
    ptr: int
    nbytes: int
    peers: list  # by rank: where its registered memory is mapped here
    mapped: list  # the peers' allocation handles mapped for it


class Registrations:
    """One device's registered memory at one rank, and the peers' allocations mapped for
    it. Every call runs on the communicator's engine, on every rank alike."""

    def __init__(self, runtime, device: int, rank: int):
        self.rt, self.device, self.rank = runtime, device, rank
        self.by_index: dict[int, Registration] = {}  # the same indices on every rank
        self._made = 0
        self._mapped: dict[str, list] = {}  # a peer's allocation: handle -> [address, users]

    def add(self, group, ptr: int, nbytes: int) -> Registration:
        """Every rank shares the allocation that holds its [ptr, ptr + nbytes) and maps the
        peers'; all ranks succeed or all raise."""
        rt, device = self.rt, self.device
        problem = handle = None
        offset = 0
        try:
            base, _ = rt.address_range(ptr, device)
            handle, offset = rt.ipc_handle(base, device).hex(), ptr - base
        except RuntimeError as e:
            problem = f"rank {self.rank} cannot share its memory through CUDA IPC: {e}"
        shared = group.allgather([handle, offset, problem])
        problem = next((p for _, _, p in shared if p), None)
        peers, mapped = [], []
        if problem is None:
            try:
                for r, (h, o, _) in enumerate(shared):
                    if r == self.rank:
                        peers.append(ptr)
                    else:
                        peers.append(self._map(h) + o)
                        mapped.append(h)
            except RuntimeError as e:
                problem = f"rank {self.rank} cannot map a peer's memory: {e}"
        problems = [p for p in group.allgather(problem) if p]
        if problems:
            for h in mapped:
                self._unmap(h)
            raise RuntimeError(problems[0])
        registration = Registration(self._made, ptr, nbytes, peers, mapped)
        self._made += 1
        self.by_index[registration.index] = registration
        return registration

    def forget(self, registration: Registration) -> None:
        if self.by_index.pop(registration.index, None) is not None:
            for h in registration.mapped:
                self._unmap(h)

    def close(self) -> None:
        for registration in list(self.by_index.values()):
            self.forget(registration)

    def of(self, buf) -> "tuple[Registration, int] | None":
        """The registration that holds all of ``buf``, and where in it ``buf`` starts."""
        for registration in self.by_index.values():
            offset = buf.ptr - registration.ptr
            if 0 <= offset and offset + buf.nbytes <= registration.nbytes:
                return registration, offset
        return None

    def placed(self, group, registration: Registration, offset: int) -> list[int]:
        """Where every rank's buffer lies, mapped here (each rank's call tells its own
        registration and offset: they may differ between ranks)."""
        return [self.by_index[k].peers[r] + o
                for r, (k, o) in enumerate(group.allgather((registration.index, offset)))]

    def _map(self, handle: str) -> int:
        """A peer's allocation, mapped once however many registrations it holds (CUDA
        maps a handle once per process)."""
        if handle not in self._mapped:
            self._mapped[handle] = [self.rt.ipc_open(bytes.fromhex(handle), self.device), 0]
        self._mapped[handle][1] += 1
        return self._mapped[handle][0]

    def _unmap(self, handle: str) -> None:
        entry = self._mapped[handle]
        entry[1] -= 1
        if entry[1] == 0:
            self.rt.ipc_close(entry[0], self.device)
            del self._mapped[handle]


class RegisteredMemory:
    """What Communicator.register returns. ``close()`` (collective, like register) unmaps it
    on every rank, after the calls before it; so does leaving a ``with`` block."""

    def __init__(self, calls, gpu, registration, array):
        self._calls, self._gpu, self.registration = calls, gpu, registration
        self._array = array  # kept alive while the peers map it

    def close(self) -> None:
        if self._gpu is None:
            return
        gpu, registration, transport = self._gpu, self.registration, self._calls.transport
        self._gpu = self._array = None
        desc = descriptor("all_reduce", "deregister", 0, NONE, NONE, NONE)

        def body():  # once every rank is done with the calls before (no peer still reads it)
            transport.agree(desc)
            gpu.registered.forget(registration)
        self._calls.engine.run("deregister", body, async_op=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._gpu is None else f"{self.registration.nbytes} bytes"
        return f"<RegisteredMemory #{self.registration.index} {state}>"


def register(calls, t, timeout=None, required: bool = True) -> "RegisteredMemory | None":
    """Share ``t``'s GPU memory with the peers (Communicator.register; ``calls``: its
    dispatch.Dispatcher). Not ``required``: None where registering cannot work, alike on
    every rank, so that a caller can fall back to plain calls."""
    try:
        return _register(calls, t, timeout)
    except (TypeError, ValueError, CommError):
        if required:
            raise
        return None


def _register(calls, t, timeout) -> RegisteredMemory:
    from ..transports import load
    buf = as_buffer(t, "t")
    if buf.device is None:
        raise TypeError("register: t is in host memory; only CUDA arrays are registered "
                        "(host memory needs no registration)")
    transport = calls.transport
    if not load("cuda_ipc").suits(transport):
        raise ValueError(f"register: needs 2 to {MAX_POINTERS} ranks of one host sharing "
                         "memory (the shm transport), and COMMLIB_CUDA_IPC not 0")
    seconds = calls.timeout if timeout is None else check_timeout(timeout)
    desc = descriptor("all_reduce", "register", 0, NONE, NONE, NONE)
    gpu = calls.gpu(buf.device.device, desc, 1, seconds)
    if not gpu.usable:
        raise CommError(f"register: CUDA IPC is unavailable here: {gpu.problem}")
    made = []

    def body():
        transport.set_timeout(seconds)
        transport.agree(desc)
        try:
            made.append(gpu.registered.add(transport.world, buf.ptr, buf.nbytes))
        except RuntimeError as e:
            raise CommError(f"register: {e}") from None
    calls.engine.run("register", body, async_op=False)
    return RegisteredMemory(calls, gpu, made[0], t)
