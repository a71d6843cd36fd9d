"""A simulated GPU with the calls of commlib._cuda that the collectives make (streams.cu,
ipc.cu, reduce_n and scale), plugged in by COMMLIB_CUDA_STREAMS=SIMULATED below: it lets
the staged and IPC collectives (commlib/cuda/staging.py, commlib/transports/cuda_ipc.py)
be tested on machines without a GPU, strictly enough that what hangs on a GPU fails here.
"Device" memory is host memory, so any object with a ``__cuda_array_interface__`` over
host memory serves as a device array (on device 0, the legacy default stream 0); memory
from device_alloc is an anonymous shared file (memfd), which peers map through the owner's
/proc/PID/fd (the IPC handle), so nothing is left in /dev/shm however a rank ends.

The device itself is C++ (simulated_gpu.cpp, compiled at first use): its streams are
threads that go on whatever Python does, its driver serialises the calls of a process
while one thread waits synchronously for a stream, its launch queue is bounded, and its
kernels are kernels.cu compiled for the CPU. Tests make slow "kernels" with ``sleep``, a
framework's kernel, whose module loads lazily (waiting for the device to go idle).

What hung on a real GPU (an H200) fails here, with an error instead of a hang:
- lazy loading: a kernel's first launch may wait for the device to go idle, so a first
  launch while a stream waits for the host's counter raises (``load_kernels`` loads all);
- a full launch queue, or a driver held by a synchronous wait, blocks every CUDA call
  behind it: a call blocked for LIMIT seconds raises;
- the communicators' engine threads make no call that orders work on a stream (there a
  CUDA call blocked behind the caller's synchronous copy, whose stream waited for that
  engine); the engine's set-up calls (memory, IPC handles) are allowed.

Whether CUDA does what streams.cu asks of it is for the GPU tests."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import subprocess
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from commlib.cuda import KERNEL_DTYPES, KERNEL_OPS, MAX_POINTERS, WIRE_FORMATS

# what a launch's environment sets to run commlib's GPU calls on this simulated device
SIMULATED = "tests.simulated_gpu:SimulatedDevice"

LAUNCH_QUEUE = 32  # operations a stream holds before enqueuing blocks (CUDA's: ~1000)
LIMIT = 30.0  # seconds a call may block before the simulated GPU calls it a hang (longer
               # than the timeouts the tests give commlib, which must fire first)
ENGINE_THREADS = "commlib-coll-"  # commlib/work.py's ProgressEngine names its thread so
# SIMULATED_GPU=lenient: engine threads may order work on streams, and synchronous waits let
# the driver go; only to measure the design before the GPU proxy, which needs both
LENIENT = os.environ.get("SIMULATED_GPU") == "lenient"
SOURCES = [Path(__file__).with_name(n) for n in ("simulated_gpu.cpp", "cuda_on_host.cpp")] + [
    Path(__file__).resolve().parents[1] / "commlib" / "cuda" / n for n in ("kernels.cu", "wire.cu")]


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """simulated_gpu.cpp, compiled once per version of its sources (by one process while
    the others wait) into ~/.cache/commlib."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "commlib"
    cache.mkdir(parents=True, exist_ok=True)
    built = cache / f"simulated_gpu-{digest}.so"
    with open(cache / "simulated_gpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            partial = built.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC",
                            "-pthread", "-o", str(partial), str(SOURCES[0])], check=True,
                           capture_output=True, text=True)
            partial.replace(built)
    lib = ctypes.CDLL(str(built))
    p, i, ll, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_double
    lg, u = ctypes.c_long, ctypes.c_uint
    for name, args, result in [
            ("sg_error", [], ctypes.c_char_p), ("sg_configure", [i, d, i], None),
            ("sg_stream_create", [], lg), ("sg_copy", [lg, p, p, ll], i),
            ("sg_sleep", [lg, d], i), ("sg_wait_value", [lg, p, u], i),
            ("sg_write_value", [lg, p, u], i), ("sg_waiting", [], i), ("sg_lazy_load", [], i),
            ("sg_reduce_n", [lg, p, ctypes.POINTER(p), i, ctypes.POINTER(p), i, ll], i),
            ("sg_scale", [lg, p, p, d, ll], i),
            ("sg_wire_encode", [lg, p, p, p, p, ll, i], i),
            ("sg_wire_decode_sum", [lg, p, p, ctypes.POINTER(p), i, ll, i, ctypes.c_float], i),
            ("sg_wire_sum_encode", [lg, p, p, p, ctypes.POINTER(p), i, ll, i, ctypes.c_float], i),
            ("sg_event_create", [], lg),
            ("sg_event_record", [lg, lg], i), ("sg_event_query", [lg], i),
            ("sg_event_wait", [lg, lg], i), ("sg_event_synchronize", [lg], i),
            ("sg_stream_synchronize", [lg], i)]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    lib.sg_configure(LAUNCH_QUEUE, LIMIT, LENIENT)
    return lib


def _checked(status: int) -> int:
    """A call's status: raises the device's error (a hang on a GPU) for -1."""
    if status < 0:
        raise RuntimeError(f"the simulated GPU: {library().sg_error().decode()}")
    return status


def _ordering(what: str) -> None:
    """A call that orders work on a stream: refused on a communicator's engine thread."""
    if threading.current_thread().name.startswith(ENGINE_THREADS) and not LENIENT:
        raise RuntimeError(f"the simulated GPU refuses {what} from a communicator's engine "
                           "thread: on a GPU such a call may block behind the caller's "
                           "synchronous copy, whose stream waits for the engine")


class HostArray:
    """A "device" array of the simulated GPU: ``host``'s memory (a numpy array or a view of
    one, which it keeps) behind the CUDA array interface. Freeing one makes no CUDA call, as
    a framework's caching allocator makes none (torch's, unless the block was used on
    several streams)."""

    def __init__(self, host: np.ndarray):
        assert host.flags.c_contiguous, "a device array is contiguous"
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": host.shape, "typestr": host.dtype.str, "strides": None,
            "data": (host.ctypes.data, False), "version": 3}


_spare_events: list[int] = []  # recycled, never destroyed, as the runtimes' Events


class _Event:
    def __init__(self):
        _ordering("creating an event")
        self.id = _spare_events.pop() if _spare_events else _checked(library().sg_event_create())

    def __del__(self):
        _spare_events.append(self.id)

    def record(self, stream: int) -> None:
        _ordering("recording an event")
        _checked(library().sg_event_record(self.id, stream))

    def query(self) -> bool:
        _ordering("querying an event")
        return _checked(library().sg_event_query(self.id)) == 1

    def wait(self, stream: int) -> None:
        _ordering("waiting for an event")
        _checked(library().sg_event_wait(self.id, stream))

    def synchronize(self) -> None:
        _ordering("waiting for an event")
        _checked(library().sg_event_synchronize(self.id))


class SimulatedDevice:
    def __init__(self):
        self._lib = library()
        self._memory: dict[int, np.ndarray] = {}
        self._pinned: dict[int, int] = {}  # host_alloc's and host_register's: their bytes
        self._shared: dict[int, mmap.mmap] = {}  # device_alloc's, and the peers' mapped
        self._owned: dict[int, int] = {}  # device_alloc's: their memfds
        self._loaded = False  # every kernel of commlib's (load_kernels)
        self._framework_loaded = False  # the tests' sleep kernel (lazily, at first launch)

    def Event(self, device: int) -> _Event:  # noqa: N802 - as commlib._cuda.Event
        return _Event()

    def host_alloc(self, nbytes: int) -> int:
        memory = np.zeros(nbytes + 64, np.uint8)
        ptr = -(-memory.ctypes.data // 64) * 64
        self._memory[ptr] = memory
        self._pinned[ptr] = nbytes
        return ptr

    def host_free(self, ptr: int) -> None:
        del self._memory[ptr], self._pinned[ptr]

    def host_register(self, ptr: int, nbytes: int) -> None:
        pinned = [(p, n) for p, n in self._pinned.items() if p < ptr + nbytes and ptr < p + n]
        if pinned:
            raise RuntimeError(f"the simulated GPU: cudaHostRegister of [{ptr:#x}, +{nbytes}): "
                               f"pinned already in {pinned}")
        self._pinned[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        if ptr in self._memory or self._pinned.pop(ptr, None) is None:
            raise RuntimeError("the simulated GPU: cudaHostUnregister of memory not registered")

    def _check_pinned(self, word: int, what: str) -> None:
        """As a stream memory operation needs: the word lies in pinned, mapped memory."""
        if not any(p <= word < p + n for p, n in self._pinned.items()):
            raise RuntimeError(f"the simulated GPU: {what} on a word that is not pinned "
                               "(host_alloc or host_register)")

    def copy_async(self, dst: int, src: int, nbytes: int, device: int, stream: int) -> None:
        _ordering("a copy")
        _checked(self._lib.sg_copy(stream, dst, src, nbytes))

    def sleep(self, stream: int, seconds: float) -> None:
        """A slow kernel of a framework's: ``stream`` waits ``seconds`` here (the tests').
        Its module loads lazily, at its first launch in the process."""
        _ordering("a kernel launch")
        if not self._framework_loaded:
            _checked(self._lib.sg_lazy_load())
            self._framework_loaded = True
        _checked(self._lib.sg_sleep(stream, seconds))

    def stream_create(self, device: int) -> int:
        _ordering("a new stream")
        return self._lib.sg_stream_create()

    def stream_synchronize(self, stream: int, device: int) -> None:
        _ordering("waiting for a stream")
        _checked(self._lib.sg_stream_synchronize(stream))

    def wait_value(self, stream: int, device: int, counter: int, value: int) -> None:
        _ordering("a wait for the host")
        self._check_pinned(counter, "cuStreamWaitValue32")
        _checked(self._lib.sg_wait_value(stream, counter, value))

    def write_value(self, stream: int, device: int, counter: int, value: int) -> None:
        _ordering("a write to the host")
        self._check_pinned(counter, "cuStreamWriteValue32")
        _checked(self._lib.sg_write_value(stream, counter, value))


    def load_kernels(self, device: int) -> None:
        self._loaded = True

    def _first_launch(self, kernel: str) -> None:
        """Lazy loading: a first launch behind a wait for the host would hang on a GPU."""
        _ordering(f"a {kernel} launch")
        if not self._loaded and self._lib.sg_waiting():
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

    # kernels: kernels.cu's, compiled for the CPU, run on the stream's thread
    def _kernel(self, name: str) -> int:
        return ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value

    def reduce_n(self, targets, sources, count, dtype, op, device, stream) -> None:
        if not (1 <= len(targets) <= MAX_POINTERS and 1 <= len(sources) <= MAX_POINTERS):
            raise ValueError(f"reduce_n: 1 to {MAX_POINTERS} targets and sources")
        self._first_launch("reduce_n")
        pointers = ctypes.c_void_p * MAX_POINTERS
        _checked(self._lib.sg_reduce_n(
            stream, self._kernel(f"commlib_reduce_n_{KERNEL_DTYPES[dtype]}_{KERNEL_OPS[op]}"),
            pointers(*targets), len(targets), pointers(*sources), len(sources), count))

    def scale(self, x, factor, count, dtype, device, stream) -> None:
        self._first_launch("scale")
        _checked(self._lib.sg_scale(stream, self._kernel(f"commlib_scale_{KERNEL_DTYPES[dtype]}"),
                                    x, factor, count))

    def wire_encode(self, data, residual, packet, count, format, block, device, stream) -> None:
        self._first_launch("wire_encode")
        _checked(self._lib.sg_wire_encode(
            stream, self._kernel(f"commlib_wire_encode_{WIRE_FORMATS[format]}"), data,
            residual or None, packet, count, block))

    def wire_decode_sum(self, out, packets, count, format, block, factor, device, stream) -> None:
        self._first_launch("wire_decode_sum")
        _checked(self._lib.sg_wire_decode_sum(
            stream, self._kernel(f"commlib_wire_decode_sum_{WIRE_FORMATS[format]}"), out,
            _packets(packets), len(packets), count, block, factor))

    def wire_sum_encode(self, packet, residual, packets, count, format, block, factor, device,
                        stream) -> None:
        self._first_launch("wire_sum_encode")
        _checked(self._lib.sg_wire_sum_encode(
            stream, self._kernel(f"commlib_wire_sum_encode_{WIRE_FORMATS[format]}"), packet,
            residual or None, _packets(packets), len(packets), count, block, factor))

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


def _packets(packets: list):
    if not 1 <= len(packets) <= MAX_POINTERS:
        raise ValueError(f"1 to {MAX_POINTERS} packets, got {len(packets)}")
    return (ctypes.c_void_p * MAX_POINTERS)(*packets)


def _close(memory: mmap.mmap) -> None:
    try:
        memory.close()
    except BufferError:  # a view still points into it: the mapping goes at exit
        pass
