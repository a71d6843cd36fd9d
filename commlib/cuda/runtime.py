"""commlib._cuda's calls through CuPy, for an install built without nvcc: kernels.cu
compiled at run time by NVRTC, and the stream, pinned-memory and IPC calls of streams.cu
and ipc.cu through CuPy's runtime bindings (cuStreamWaitValue32, which CuPy does not bind,
from libcuda through ctypes). Importing this module fails without CuPy."""
import ctypes
import math
from contextlib import contextmanager
from functools import lru_cache

import cupy
import numpy as np
from cupy.cuda import runtime

from .. import settings
from ..dtypes import BY_CODE
from .kernel_names import KERNEL_DTYPES, KERNEL_OPS, MAX_POINTERS, WIRE_FORMATS, source

_THREADS = 256  # as csrc/cuda/launch.cu
_NOT_READY = 600  # cudaErrorNotReady (CuPy names no constant for it)
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: after the earlier work and its memory


@lru_cache(maxsize=None)
def _driver():
    """libcuda's cuStreamWaitValue32 and cuStreamWriteValue32 (the CUDA 12 semantics),
    cuMemHostGetDevicePointer and cuMemGetAddressRange."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        wait, write = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"no cuStreamWaitValue32_v2 in libcuda.so.1 ({e}); collectives on "
                           "GPU memory need a CUDA 12 or newer driver") from None
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    device_pointer = lib.cuMemHostGetDevicePointer_v2
    device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    address_range = lib.cuMemGetAddressRange_v2
    address_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                              ctypes.c_uint64]
    return wait, device_pointer, address_range, write


def _pointers(addresses):
    """kernels.cu's Sources or Targets, by value: CuPy (14 and newer) passes a structured
    NumPy scalar as a struct."""
    table = np.zeros(1, dtype=[("p", np.uint64, MAX_POINTERS)])[0]
    table["p"][:len(addresses)] = addresses
    return table


def _wire_work(format: int, count: int, block: int, what: str) -> int:
    if not 0 <= format < len(WIRE_FORMATS):
        raise ValueError(f"{what}: unknown wire format code {format}")
    scaled = format >= WIRE_FORMATS.index("int8")  # (csrc/wire.h: the scaled ones last)
    if scaled and block not in (32, 64, 128, 256):
        raise ValueError(f"{what}: block must be 32, 64, 128 or 256 elements, not {block}")
    return -(-count // block) if scaled else count


def _packets(packets, what: str):
    if not 1 <= len(packets) <= MAX_POINTERS:
        raise ValueError(f"{what}: 1 to {MAX_POINTERS} packets, got {len(packets)}")
    return _pointers(packets)


@contextmanager
def _driver_on(device: int):
    """On `device` with its primary context current on this thread, as a libcuda call needs:
    cudaSetDevice makes it so, and CuPy's Device skips that where the device is current
    already (a thread that has made no runtime call yet has no context)."""
    with cupy.cuda.Device(device):
        runtime.setDevice(device)
        yield


def _multiprocessors(device: int) -> int:
    return runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


_spare_events: dict[int, list[int]] = {}  # per device: events to reuse (streams.cu says why)


class Event:
    """A CUDA event on one device (timing disabled), as commlib._cuda.Event; recycled, never
    destroyed, as there."""

    def __init__(self, device: int):
        self.device = device
        spare = _spare_events.setdefault(device, [])
        try:
            self.event = spare.pop()
        except IndexError:
            with cupy.cuda.Device(device):
                self.event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)

    def __del__(self):
        _spare_events.setdefault(self.device, []).append(self.event)

    def record(self, stream: int) -> None:
        with cupy.cuda.Device(self.device):
            runtime.eventRecord(self.event, stream)

    def query(self) -> bool:
        status = runtime.eventQuery(self.event)
        if status not in (0, _NOT_READY):
            raise RuntimeError(f"cudaEventQuery failed with cudaError {status}")
        return status == 0

    def wait(self, stream: int) -> None:
        with cupy.cuda.Device(self.device):
            runtime.streamWaitEvent(stream, self.event)

    def synchronize(self) -> None:
        runtime.eventSynchronize(self.event)


class CupyRuntime:
    Event = Event

    def __init__(self):
        self.BUILD_INFO = {"cuda_version": str(runtime.runtimeGetVersion()),
                           "compiled_by": "nvrtc (cupy)"}
        self._module = cupy.RawModule(code=source(), options=("-std=c++17",))
        # COMMLIB_CUDA_WAIT=kernel: streams wait for counters by a kernel (as streams.cu)
        self._wait_by_kernel = settings.get("COMMLIB_CUDA_WAIT") == "kernel"
        self._loaded: set[int] = set()  # devices load_kernels has loaded every kernel on

    @staticmethod
    def device_count() -> int:
        try:
            return runtime.getDeviceCount()
        except runtime.CUDARuntimeError:
            return 0

    # kernels (kernels.cu)
    def load_kernels(self, device: int) -> None:
        """Every kernel loaded on ``device`` now, once (csrc/cuda/launch.cu says why)."""
        if device in self._loaded:
            return
        ops = sorted(set(KERNEL_OPS))
        floating = [d.kernel for d in BY_CODE if d.floating]
        names = [f"commlib_{kind}_{dtype}_{op}" for kind in ("reduce", "reduce_n")
                 for dtype in KERNEL_DTYPES for op in ops]
        names += [f"commlib_scale_{dtype}" for dtype in floating]
        names += [f"commlib_cast_{a}_{b}" for a in floating for b in floating]
        names += [f"commlib_wire_{kind}_{fmt}" for kind in ("encode", "decode_sum", "sum_encode")
                  for fmt in WIRE_FORMATS]
        with cupy.cuda.Device(device):
            for name in [*names, "commlib_copy", "commlib_wait_counter", "commlib_write_counter"]:
                self._module.get_function(name).num_regs  # reading an attribute loads it
        self._loaded.add(device)

    def _launch(self, name, work, args, device, stream):
        if work <= 0:
            return
        with cupy.cuda.Device(device):
            blocks = max(1, min(math.ceil(work / _THREADS), 8 * _multiprocessors(device)))
            self._module.get_function(name)((blocks,), (_THREADS,), args,
                                            stream=cupy.cuda.ExternalStream(stream))

    def reduce(self, dst, a, b, count, dtype, op, device, stream):
        work = math.ceil(count * BY_CODE[dtype].itemsize / 16)
        self._launch(f"commlib_reduce_{KERNEL_DTYPES[dtype]}_{KERNEL_OPS[op]}", work,
                     (np.uint64(dst), np.uint64(a), np.uint64(b), np.int64(count)), device, stream)

    def reduce_n(self, targets, sources, count, dtype, op, device, stream):
        if not (1 <= len(targets) <= MAX_POINTERS and 1 <= len(sources) <= MAX_POINTERS):
            raise ValueError(f"reduce_n: 1 to {MAX_POINTERS} targets and sources, got "
                             f"{len(targets)} and {len(sources)}")
        work = math.ceil(count * BY_CODE[dtype].itemsize / 16)
        self._launch(f"commlib_reduce_n_{KERNEL_DTYPES[dtype]}_{KERNEL_OPS[op]}", work,
                     (_pointers(targets), np.int32(len(targets)), _pointers(sources),
                      np.int32(len(sources)), np.int64(count)), device, stream)

    def scale(self, x, factor, count, dtype, device, stream):
        self._launch(f"commlib_scale_{KERNEL_DTYPES[dtype]}",
                     math.ceil(count * BY_CODE[dtype].itemsize / 16),
                     (np.uint64(x), np.float64(factor), np.int64(count)), device, stream)

    def cast(self, dst, src, count, src_dtype, dst_dtype, device, stream):
        wider = max(BY_CODE[src_dtype].itemsize, BY_CODE[dst_dtype].itemsize)
        self._launch(f"commlib_cast_{KERNEL_DTYPES[src_dtype]}_{KERNEL_DTYPES[dst_dtype]}",
                     math.ceil(count * wider / 16),
                     (np.uint64(dst), np.uint64(src), np.int64(count)), device, stream)

    def copy(self, dst, src, nbytes, device, stream):
        self._launch("commlib_copy", math.ceil(nbytes / 16),
                     (np.uint64(dst), np.uint64(src), np.int64(nbytes)), device, stream)

    # the wire formats (wire.cu); launch.cu's checks, its threads (a block each for a
    # scaled format's encoding, else an element)
    def wire_encode(self, data, residual, packet, count, format, block, device, stream):
        self._launch(f"commlib_wire_encode_{WIRE_FORMATS[format]}",
                     _wire_work(format, count, block, "wire_encode"),
                     (np.uint64(data), np.uint64(residual), np.uint64(packet), np.int64(count),
                      np.int32(block)), device, stream)

    def wire_decode_sum(self, out, packets, count, format, block, factor, device, stream):
        _wire_work(format, count, block, "wire_decode_sum")
        self._launch(f"commlib_wire_decode_sum_{WIRE_FORMATS[format]}", count,
                     (np.uint64(out), _packets(packets, "wire_decode_sum"),
                      np.int32(len(packets)), np.int64(count), np.int32(block),
                      np.float32(factor)), device, stream)

    def wire_sum_encode(self, packet, residual, packets, count, format, block, factor, device,
                        stream):
        self._launch(f"commlib_wire_sum_encode_{WIRE_FORMATS[format]}",
                     _wire_work(format, count, block, "wire_sum_encode"),
                     (np.uint64(packet), np.uint64(residual),
                      _packets(packets, "wire_sum_encode"), np.int32(len(packets)),
                      np.int64(count), np.int32(block), np.float32(factor)), device, stream)

    # streams and pinned memory (streams.cu)
    @staticmethod
    def host_alloc(nbytes: int) -> int:
        # mapped: cuStreamWaitValue32 reads counters in it from the device
        return runtime.hostAlloc(max(nbytes, 1),
                                 runtime.hostAllocPortable | runtime.hostAllocMapped)

    @staticmethod
    def host_free(ptr: int) -> None:
        runtime.freeHost(ptr)

    @staticmethod
    def host_register(ptr: int, nbytes: int) -> None:
        runtime.hostRegister(ptr, nbytes, runtime.hostRegisterPortable |
                             runtime.hostRegisterMapped)

    @staticmethod
    def host_unregister(ptr: int) -> None:
        runtime.hostUnregister(ptr)


    @staticmethod
    def copy_async(dst: int, src: int, nbytes: int, device: int, stream: int) -> None:
        if nbytes:
            with cupy.cuda.Device(device):
                runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDefault, stream)

    @staticmethod
    def stream_create(device: int) -> int:
        with cupy.cuda.Device(device):
            return runtime.streamCreateWithFlags(runtime.streamNonBlocking)

    @staticmethod
    def stream_synchronize(stream: int, device: int) -> None:
        with cupy.cuda.Device(device):
            runtime.streamSynchronize(stream)

    def _on_device(self, counter: int) -> int:
        """``counter`` (pinned, from host_alloc) as the device addresses it."""
        on_device = ctypes.c_uint64()
        _check(_driver()[1](ctypes.byref(on_device), counter, 0),
               "cuMemHostGetDevicePointer (the counter must be from host_alloc)")
        return on_device.value

    def _stream_value(self, stream, device, counter, value, kernel, op, flags, what):
        """A stream memory operation on the word at ``counter`` (pinned): libcuda's ``op``
        (an index into _driver()) with ``flags``, or our ``kernel`` (COMMLIB_CUDA_WAIT=kernel)."""
        with _driver_on(device):
            word = self._on_device(counter)
            if self._wait_by_kernel:
                self._module.get_function(kernel)((1,), (1,), (np.uint64(word), np.uint32(value)),
                                                  stream=cupy.cuda.ExternalStream(stream))
                return
            _check(_driver()[op](stream, word, value, flags), what)

    def wait_value(self, stream: int, device: int, counter: int, value: int) -> None:
        self._stream_value(stream, device, counter, value, "commlib_wait_counter", 0, _WAIT_GEQ,
                           "cuStreamWaitValue32")

    def write_value(self, stream: int, device: int, counter: int, value: int) -> None:
        self._stream_value(stream, device, counter, value, "commlib_write_counter", 3,
                           _WRITE_DEFAULT, "cuStreamWriteValue32")

    @staticmethod
    def store_counter(counter: int, value: int) -> None:
        # a plain store: x86 keeps it after the host's earlier writes (the staged results)
        ctypes.c_uint32.from_address(counter).value = value

    @staticmethod
    def device_of(ptr: int) -> int:
        attributes = runtime.pointerGetAttributes(ptr)
        if attributes.type not in (runtime.memoryTypeDevice, runtime.memoryTypeManaged):
            raise ValueError("the pointer is not device memory")
        return attributes.device

    # device memory shared between processes (ipc.cu)
    @staticmethod
    def device_alloc(nbytes: int, device: int) -> int:
        with cupy.cuda.Device(device):
            return runtime.malloc(max(nbytes, 1))

    @staticmethod
    def device_free(ptr: int, device: int) -> None:
        with cupy.cuda.Device(device):
            runtime.free(ptr)

    @staticmethod
    def address_range(ptr: int, device: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with _driver_on(device):
            _check(_driver()[2](ctypes.byref(base), ctypes.byref(size), ptr),
                   "cuMemGetAddressRange (not device memory from cudaMalloc?)")
        return base.value, size.value

    @staticmethod
    def ipc_handle(ptr: int, device: int) -> bytes:
        with cupy.cuda.Device(device):
            return runtime.ipcGetMemHandle(ptr)

    @staticmethod
    def ipc_open(handle: bytes, device: int) -> int:
        with cupy.cuda.Device(device):
            return runtime.ipcOpenMemHandle(handle)

    @staticmethod
    def ipc_close(ptr: int, device: int) -> None:
        with cupy.cuda.Device(device):
            runtime.ipcCloseMemHandle(ptr)

    @staticmethod
    def can_access(device: int, peer: int) -> bool:
        return device == peer or bool(runtime.deviceCanAccessPeer(device, peer))

    @staticmethod
    def device_uuid(device: int) -> bytes:
        """Names the physical GPU alike in every process (whatever CUDA_VISIBLE_DEVICES)."""
        return cupy.cuda.Device(device).pci_bus_id.encode()
