"""Communicator.empty: host memory that every rank of the host maps, so that one_copy
collectives on it read the peers' data where it lies, with no copy into staging and no
system call (csrc/shm_one_copy.cpp, "region"). Like ncclMemAlloc: for buffers used again
and again (gradient buckets, activations); a call on other memory works as before.

Allocating is collective: each rank creates a shared-memory object of the same size, the
names travel through the world, every rank maps every peer's, then each unlinks its own,
so nothing is left in /dev/shm whatever happens. The arrays (numpy, or torch tensors for
a torch dtype) hold a buffer over the mapping; once the last of them is collected, the
owner stops publishing the region and only then unmaps it (so a peer never reads an
address reused after it), and the peers drop their mappings of it at the next allocation
or when the communicator closes.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import secrets
import weakref

import numpy as np

from .errors import CommError


class SharedHostMemory:
    """One communicator's regions: its own (kept alive by the arrays handed out) and the
    peers' (mapped here until their owners free them). Collective calls run on every rank
    alike, on the communicator's engine."""

    def __init__(self, shm, world):
        self.shm, self.world = shm, world  # the C++ ShmComm; the ranks' world
        self.rank = world.rank
        self._made = 0
        self._own: dict[int, mmap.mmap] = {}  # index -> mapping, while arrays use it
        self._freed: list[int] = []  # own regions collected since the last allocation
        self._peers: dict[tuple[int, int], mmap.mmap] = {}  # (owner, index) -> mapping

    def allocate(self, nbytes: int):
        """``nbytes`` of memory that every rank maps too (collective)."""
        index, self._made = self._made, self._made + 1
        size = max(mmap.PAGESIZE, math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE)
        path, mine, error, fd = None, None, None, None
        try:
            path = f"/dev/shm/commlib-{os.getuid()}-{os.getpid()}-m{index}-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                mine = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as e:
            error = f"rank {self.rank}: {e} (is /dev/shm full?)"
            if fd is not None:  # made, but not mapped (no memory left to map it, say)
                os.unlink(path)
        freed, self._freed = self._freed, []
        shared = self.world.allgather([path if error is None else None, _address(mine), freed])
        self._forget([(r, i) for r, (_, _, gone) in enumerate(shared) for i in gone])
        mapped = {}
        if error is None and all(p for p, _, _ in shared):
            try:
                for r, (peer_path, _, _) in enumerate(shared):
                    if r != self.rank:
                        mapped[r] = _map(peer_path, size)
            except OSError as e:
                error = f"rank {self.rank} cannot map a peer's memory: {e}"
        errors = self.world.allgather(error)  # every rank has mapped (or given up): unlink
        if path is not None and mine is not None:
            os.unlink(path)
        problem = next((e for e in errors if e), None)
        if problem:
            raise CommError(f"empty: shared host memory could not be set up: {problem}")
        for r, peer in mapped.items():
            self._peers[r, index] = peer
            self.shm.add_region(r, index, shared[r][1], _address(peer), size)
        base = _address(mine)
        self.shm.add_region(self.rank, index, base, base, size)
        self._own[index] = mine
        # what the arrays hold (numpy keeps it as their base; a memoryview would not do:
        # numpy and torch take views of the underlying mapping instead)
        holder = (ctypes.c_char * size).from_buffer(mine)
        # (not at exit: arrays may still use it, and the process unmaps everything anyway)
        weakref.finalize(holder, self._collected, weakref.ref(self), index).atexit = False
        return holder

    @staticmethod
    def _collected(owner_ref, index: int) -> None:
        """Nothing uses own region ``index`` any more: stop publishing it, then unmap it;
        the peers hear of it at the next allocation."""
        owner = owner_ref()
        if owner is None:
            return
        if owner.shm is not None:
            owner.shm.remove_region(owner.rank, index)
            owner._freed.append(index)
        owner._own.pop(index)  # unmapped as the holder goes (it exports the mapping still)

    def drop_freed(self) -> None:
        """Unmap the peers' regions that their owners have freed since the last allocation
        (collective; each allocation does so first)."""
        freed, self._freed = self._freed, []
        gone = self.world.allgather(freed)
        self._forget([(r, i) for r, indices in enumerate(gone) for i in indices])

    def _forget(self, regions) -> None:
        for owner, index in regions:
            if owner != self.rank and (owner, index) in self._peers:
                self.shm.remove_region(owner, index)
                self._peers.pop((owner, index)).close()

    def close(self) -> None:
        """Unmap the peers' regions (the communicator's transport is closing); arrays
        still in use keep their own memory."""
        self._forget(list(self._peers))
        for index in list(self._own):
            self.shm.remove_region(self.rank, index)
        self.shm = None


def _address(mapping: mmap.mmap | None) -> int:
    return 0 if mapping is None else np.frombuffer(mapping, np.uint8).ctypes.data


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} has another size: the ranks asked for different shapes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def as_array(memory, shape: tuple, dtype):
    """A numpy array, or a torch tensor for a torch dtype, of ``shape`` over ``memory``
    (the tensor through a numpy array, which it keeps alive, and that keeps ``memory``)."""
    if type(dtype).__module__ == "torch":
        import torch
        raw = np.frombuffer(memory, np.uint8, math.prod(shape) * dtype.itemsize)
        return torch.from_numpy(raw).view(dtype).view(shape)
    return np.frombuffer(memory, dtype, math.prod(shape)).reshape(shape)
