"""A simulated GPU with the calls of commlib._cuda that the collectives make (streams.cu,
ipc.cu, reduce_n and scale), plugged in by COMMLIB_CUDA_STREAMS=SIMULATED below: it lets
the staged and IPC collectives' ordering (commlib/cuda/staging.py,
commlib/transports/cuda_ipc.py) be tested on machines without a GPU.
"Device" memory is host memory, so any object with a ``__cuda_array_interface__`` over
host memory serves as a device array (on device 0, the legacy default stream 0); memory
from device_alloc is an anonymous shared file (memfd), which peers map through the owner's
/proc/PID/fd (the IPC handle).
Each stream is a thread that runs its operations in order, as a GPU runs a stream's.
Tests make slow "kernels" with ``enqueue``.

What hung on a real GPU (an H200) is refused here, with an error instead of a hang:
- lazy loading: a kernel's first launch may wait for the device to go idle, so a first
  launch while a stream waits for the host's counter raises (``load_kernels`` loads all);
- a stream's launch queue is bounded, as CUDA's is: enqueuing onto a full one blocks, and
  raises if the stream does not drain within QUEUE_SECONDS;
- the communicators' engine threads enqueue nothing (there a CUDA call blocked behind the
  caller's synchronous copy, whose stream waited for that engine).

It checks the ordering logic only; whether CUDA does what streams.cu asks of it is for the
GPU tests."""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import threading
import time

import numpy as np

from commlib.dtypes import BY_CODE

# what a launch's environment sets to run commlib's GPU calls on this simulated device
SIMULATED = "tests.simulated_gpu:SimulatedDevice"

LAUNCH_QUEUE = 32  # operations a stream holds before enqueuing blocks (CUDA's: ~1000)
QUEUE_SECONDS = 20.0
ENGINE_THREADS = "commlib-coll-"  # commlib/work.py's ProgressEngine names its thread so

# numpy's reductions by op code
_REDUCE = (np.add, np.multiply, np.minimum, np.maximum, np.add)


def _spin_until(condition) -> None:
    while not condition():
        time.sleep(20e-6)


class _Stream:
    def __init__(self, handle: int):
        self.ops: queue.Queue = queue.Queue(LAUNCH_QUEUE)
        threading.Thread(target=self._run, name=f"simulated-stream-{handle}", daemon=True).start()

    def _run(self):
        while True:
            self.ops.get()()


class _Event:
    def __init__(self, device_sim: "SimulatedDevice"):
        self._sim = device_sim
        self._recorded = self._passed = 0

    def record(self, stream: int) -> None:
        self._recorded += 1
        generation = self._recorded

        def passed():
            self._passed = max(self._passed, generation)
        self._sim.enqueue(stream, passed)

    def query(self) -> bool:
        return self._passed >= self._recorded

    def wait(self, stream: int) -> None:
        generation = self._recorded
        self._sim.enqueue(stream, lambda: _spin_until(lambda: self._passed >= generation))

    def synchronize(self) -> None:
        _spin_until(self.query)


class SimulatedDevice:
    def __init__(self):
        self._streams: dict[int, _Stream] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._memory: dict[int, np.ndarray] = {}
        self._shared: dict[int, mmap.mmap] = {}  # device_alloc's, and the peers' mapped
        self._owned: dict[int, int] = {}  # device_alloc's: their memfds
        self._loaded = False  # every kernel (load_kernels)
        self._waiting = 0  # enqueued waits for a counter that have not passed yet

    def enqueue(self, stream: int, op) -> None:
        """Run ``op()`` on ``stream``'s thread after what the stream already holds."""
        if threading.current_thread().name.startswith(ENGINE_THREADS):
            raise RuntimeError("the simulated GPU refuses work enqueued by a communicator's "
                               "engine thread: on a GPU such a call may block behind the "
                               "caller's synchronous copy, whose stream waits for the engine")
        with self._lock:
            if stream not in self._streams:
                self._streams[stream] = _Stream(stream)
            target = self._streams[stream]
        try:
            target.ops.put(op, timeout=QUEUE_SECONDS)
        except queue.Full:
            raise RuntimeError(f"the simulated GPU's stream {stream} stayed full for "
                               f"{QUEUE_SECONDS:g} s: nothing drains it while this thread "
                               "enqueues (on a GPU: a hang)") from None

    def Event(self, device: int) -> _Event:  # noqa: N802 - as commlib._cuda.Event
        return _Event(self)

    def host_alloc(self, nbytes: int) -> int:
        memory = np.zeros(nbytes + 64, np.uint8)
        ptr = -(-memory.ctypes.data // 64) * 64
        self._memory[ptr] = memory
        return ptr

    def host_free(self, ptr: int) -> None:
        del self._memory[ptr]

    def copy_async(self, dst: int, src: int, nbytes: int, device: int, stream: int) -> None:
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def stream_create(self, device: int) -> int:
        return next(self._handles)

    def stream_synchronize(self, stream: int, device: int) -> None:
        done = threading.Event()
        self.enqueue(stream, done.set)
        done.wait()

    def wait_value(self, stream: int, device: int, counter: int, value: int) -> None:
        word = ctypes.c_uint32.from_address(counter)

        def wait():
            _spin_until(lambda: (word.value - value) & 0xFFFFFFFF < 0x80000000)  # cyclic >=
            with self._lock:
                self._waiting -= 1
        with self._lock:
            self._waiting += 1
        self.enqueue(stream, wait)

    def write_value(self, stream: int, device: int, counter: int, value: int) -> None:
        word = ctypes.c_uint32.from_address(counter)
        self.enqueue(stream, lambda: setattr(word, "value", value))

    def load_kernels(self, device: int) -> None:
        self._loaded = True

    def _first_launch(self, kernel: str) -> None:
        """Lazy loading: a first launch behind a wait for the host would hang on a GPU."""
        with self._lock:
            if not self._loaded and self._waiting:
                raise RuntimeError(
                    f"the simulated GPU's first {kernel} launch came while a stream waits for "
                    "the host: under lazy loading it would wait for the device to go idle, "
                    "for good (call load_kernels before enqueuing a wait)")

    @staticmethod
    def store_counter(counter: int, value: int) -> None:
        ctypes.c_uint32.from_address(counter).value = value

    @staticmethod
    def device_of(ptr: int) -> int:
        return 0

    # kernels
    @staticmethod
    def _array(ptr: int, count: int, dtype: int) -> np.ndarray:
        kind = BY_CODE[dtype].numpy
        if kind is None:
            raise TypeError("the simulated GPU has no bfloat16")
        raw = (ctypes.c_uint8 * (count * kind.itemsize)).from_address(ptr)
        return np.frombuffer(raw, kind)

    def reduce_n(self, targets, sources, count, dtype, op, device, stream) -> None:
        self._first_launch("reduce_n")

        def run():
            arrays = [self._array(p, count, dtype) for p in sources]
            acc = arrays[0].copy()
            for a in arrays[1:]:
                _REDUCE[op](acc, a, out=acc)
            for p in targets:
                self._array(p, count, dtype)[:] = acc
        self.enqueue(stream, run)

    def scale(self, x, factor, count, dtype, device, stream) -> None:
        self._first_launch("scale")

        def run():
            a = self._array(x, count, dtype)
            a[:] = (a * factor).astype(a.dtype)
        self.enqueue(stream, run)

    # IPC: device memory in anonymous shared files (memfd), which peers map through the
    # owner's /proc/PID/fd (the handle): nothing is ever named in /dev/shm, so nothing is
    # left there however a rank ends, and the memory goes with its last mapping
    def _map(self, fd: int, nbytes: int) -> int:
        memory = mmap.mmap(fd, nbytes)
        ptr = ctypes.addressof(ctypes.c_uint8.from_buffer(memory))
        self._shared[ptr] = memory
        return ptr

    def device_alloc(self, nbytes: int, device: int) -> int:
        fd = os.memfd_create("simulated-gpu-memory")
        os.ftruncate(fd, max(nbytes, 1))
        ptr = self._map(fd, max(nbytes, 1))
        self._owned[ptr] = fd  # kept open while peers may still open it
        return ptr

    def device_free(self, ptr: int, device: int) -> None:
        os.close(self._owned.pop(ptr))
        _close(self._shared.pop(ptr))

    def address_range(self, ptr: int, device: int) -> tuple[int, int]:
        for base, memory in self._shared.items():
            if base <= ptr < base + len(memory):
                return base, len(memory)
        raise RuntimeError("address_range: not device memory from device_alloc")

    def ipc_handle(self, ptr: int, device: int) -> bytes:
        return f"/proc/{os.getpid()}/fd/{self._owned[ptr]}".encode().ljust(64, b"\0")

    def ipc_open(self, handle: bytes, device: int) -> int:
        fd = os.open(handle.rstrip(b"\0").decode(), os.O_RDWR)
        try:
            return self._map(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def ipc_close(self, ptr: int, device: int) -> None:
        _close(self._shared.pop(ptr))

    @staticmethod
    def can_access(device: int, peer: int) -> bool:
        return True

    @staticmethod
    def device_uuid(device: int) -> bytes:
        return b"simulated gpu 0".ljust(16, b"\0")

    @staticmethod
    def device_count() -> int:
        return 1


def _close(memory: mmap.mmap) -> None:
    try:
        memory.close()
    except BufferError:  # a view still points into it: the mapping goes at exit
        pass
