"""A simulated GPU with the stream calls of commlib._cuda (streams.cu), chosen by
COMMLIB_CUDA_SIMULATE=1: it lets the staged collectives' ordering (staging.py) be tested
on machines without a GPU. "Device" memory is host memory, so any object with a
``__cuda_array_interface__`` over host memory serves as a device array (on device 0, the
legacy default stream 0), and each stream is a thread that runs its operations in order,
as a GPU runs a stream's. Tests make slow "kernels" with ``enqueue``.

It checks the ordering logic only; whether CUDA does what streams.cu asks of it is for the
GPU tests."""
from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time

import numpy as np


def _spin_until(condition) -> None:
    while not condition():
        time.sleep(20e-6)


class _Stream:
    def __init__(self, handle: int):
        self.ops: queue.Queue = queue.Queue()
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

    def enqueue(self, stream: int, op) -> None:
        """Run ``op()`` on ``stream``'s thread after what the stream already holds."""
        with self._lock:
            if stream not in self._streams:
                self._streams[stream] = _Stream(stream)
            target = self._streams[stream]
        target.ops.put(op)

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
        self.enqueue(stream, lambda: _spin_until(
            lambda: (word.value - value) & 0xFFFFFFFF < 0x80000000))  # cyclic >=

    @staticmethod
    def store_counter(counter: int, value: int) -> None:
        ctypes.c_uint32.from_address(counter).value = value

    @staticmethod
    def device_of(ptr: int) -> int:
        return 0
