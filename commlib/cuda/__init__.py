"""The GPU path's kernels (kernels.cu) on torch CUDA tensors and CuPy arrays.

They come from commlib._cuda where commlib was built with nvcc, else through CuPy
(runtime.py: the same source compiled at run time by NVRTC; the stream and IPC calls of
the collectives on GPU memory through CuPy's CUDA bindings). Each call is enqueued on the
current stream of the array's framework on the array's device and returns at once, as
NCCL's calls do; synchronise that stream before reading the result on the host.
"""
import re
from functools import lru_cache
from typing import NamedTuple

from .. import settings
from ..dtypes import BY_TYPESTR, DTYPES as DTYPE_TABLE, DType
from .kernel_names import (DTYPES, FLOATING, KERNEL_DTYPES, KERNEL_OPS,  # noqa: F401
                           MAX_POINTERS, OPS, WIRE_FORMATS, source)


class CudaUnavailable(RuntimeError):
    """No CUDA kernels here: commlib was built without nvcc and CuPy is not installed."""


def _prefer_cupy() -> bool:
    """COMMLIB_CUDA_RUNTIME=cupy: go through CuPy even where commlib._cuda was built (to
    test that path on a GPU machine)."""
    return settings.get("COMMLIB_CUDA_RUNTIME") == "cupy"


@lru_cache(maxsize=None)
def kernels():
    """The GPU calls: commlib._cuda, else the same through CuPy (runtime.CupyRuntime)."""
    if not _prefer_cupy():
        try:
            from .. import _cuda
            return _cuda
        except ImportError:
            pass
    try:
        from .runtime import CupyRuntime
    except ImportError as e:
        raise CudaUnavailable(
            "no CUDA kernels: commlib was built without nvcc and CuPy is not installed; "
            "reinstall commlib with nvcc on PATH (or CUDA_HOME set), or pip install "
            "cupy-cuda13x to compile them at run time") from e
    return CupyRuntime()


def mpi_is_cuda_aware() -> bool:
    """Whether the MPI library moves GPU memory itself (CUDA-aware), so that send and recv
    hand it device pointers instead of staging through host memory.
    COMMLIB_CUDA_AWARE_MPI=1 or 0 says so (read at each call, as worlds are made); else the
    loaded libmpi's MPIX_Query_cuda_support (Open MPI and MPICH have it) is asked, once.
    Call once MPI is initialised."""
    return _mpi_is_cuda_aware(settings.get("COMMLIB_CUDA_AWARE_MPI"))


@lru_cache(maxsize=None)
def _mpi_is_cuda_aware(said: str | None) -> bool:
    if said in ("0", "1"):
        return said == "1"
    import ctypes
    with open("/proc/self/maps") as maps:
        libmpi = next((line.split()[-1] for line in maps
                       if re.search(r"/libmpi[^/]*\.so", line)), None)
    if libmpi is None:  # MPI not loaded (yet)
        return False
    try:
        query = ctypes.CDLL(libmpi).MPIX_Query_cuda_support
    except (OSError, AttributeError):  # gone, or an MPI without the call
        return False
    query.restype = ctypes.c_int
    return bool(query())


def streams():
    """The stream-ordering calls of the collectives on GPU memory (staging.py,
    transports/cuda_ipc.py): kernels()'s, or those of the object COMMLIB_CUDA_STREAMS names
    as module:class (the tests' simulated GPU, tests/simulated_gpu.py), one per setting."""
    return _streams(settings.get("COMMLIB_CUDA_STREAMS"))


@lru_cache(maxsize=None)
def _streams(plugged: str | None):
    if plugged:
        import importlib
        module, cls = plugged.split(":")
        return getattr(importlib.import_module(module), cls)()
    return kernels()


def build_info() -> dict:
    """What the GPU path has: kernels compiled at build time (CUDA version, nvcc flags),
    or compiled at run time through CuPy, or none."""
    if not _prefer_cupy():
        try:
            from .. import _cuda
            return {"cuda": True, "compiled_by": "nvcc", **_cuda.BUILD_INFO}
        except ImportError:
            pass
    try:
        import cupy  # noqa: F401
    except ImportError:
        return {"cuda": False, "compiled_by": None}
    return {"cuda": True, "compiled_by": "nvrtc (cupy, at first use)"}


def device_count() -> int:
    """CUDA devices this process sees; 0 without a driver, a device or any kernels."""
    try:
        return kernels().device_count()
    except CudaUnavailable:
        return 0


class DeviceArray(NamedTuple):
    ptr: int
    count: int
    dtype: DType
    device: int
    stream: int  # the framework's current stream on that device
    framework: str  # torch, cupy, or other (__cuda_array_interface__)

    @property
    def code(self) -> int:
        return self.dtype.code

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def device_array(x, what: str = "array") -> DeviceArray:
    """A contiguous torch CUDA tensor, or an object with __cuda_array_interface__ (CuPy)."""
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        import torch
        if not x.is_cuda:
            raise TypeError(f"{what}: a CPU tensor where a CUDA tensor is needed; move it with "
                            ".cuda() or use the CPU collectives")
        if not x.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous; call .contiguous() first")
        dtype = DTYPE_TABLE.get(str(x.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"{what}: unsupported dtype {x.dtype}; supported: {', '.join(DTYPES)}")
        return DeviceArray(x.data_ptr(), x.numel(), dtype, x.device.index,
                           torch.cuda.current_stream(x.device).cuda_stream, "torch")
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{what}: {type(x).__name__} is not a CUDA array (a torch CUDA tensor "
                        "or an object with __cuda_array_interface__, such as a CuPy array)")
    dtype = BY_TYPESTR.get(cai["typestr"][1:])
    if dtype is None:
        raise TypeError(f"{what}: unsupported typestr {cai['typestr']!r}")
    count = 1
    for n in cai["shape"]:
        count *= n
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None and count > 1:
        expected, contiguous = itemsize, True
        for n, s in reversed(list(zip(cai["shape"], strides))):
            contiguous &= n == 1 or s == expected
            expected *= n
        if not contiguous:
            raise ValueError(f"{what}: array is not C-contiguous; copy it first")
    if module == "cupy":
        import cupy
        device, stream = x.device.id, cupy.cuda.get_current_stream(x.device.id).ptr
    else:  # no framework to ask: the device that owns the pointer, the legacy default stream
        device, stream = _device_of(cai["data"][0]), 0
    return DeviceArray(cai["data"][0], count, dtype, device, stream, module)


def current_stream(array: DeviceArray) -> int:
    """The current stream, now, of ``array``'s framework on its device."""
    if array.framework == "torch":
        import torch
        return torch.cuda.current_stream(array.device).cuda_stream
    if array.framework == "cupy":
        import cupy
        return cupy.cuda.get_current_stream(array.device).ptr
    return 0


def _device_of(ptr: int) -> int:
    return streams().device_of(ptr)


def _same_device(*arrays: DeviceArray) -> None:
    devices = {a.device for a in arrays}
    if len(devices) > 1:
        raise ValueError(f"arrays on different devices {sorted(devices)}; put them on one")


def reduce(dst, a, b, op: str = "sum") -> None:
    """dst = a op b elementwise (avg reduces as sum: scale() divides). dst may be a or b."""
    d, x, y = device_array(dst, "dst"), device_array(a, "a"), device_array(b, "b")
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(OPS)}")
    if not d.count == x.count == y.count or not d.dtype == x.dtype == y.dtype:
        raise ValueError(f"reduce: dst, a, b must match, got {d.count} {d.dtype.name}, "
                         f"{x.count} {x.dtype.name}, {y.count} {y.dtype.name}")
    _same_device(d, x, y)
    kernels().reduce(d.ptr, x.ptr, y.ptr, d.count, d.code, OPS.index(op), d.device, d.stream)


def scale(x, factor: float) -> None:
    """x *= factor, in x's precision (float dtypes)."""
    a = device_array(x, "x")
    if not a.dtype.floating:
        raise TypeError(f"scale: {a.dtype.name} is not a floating dtype")
    kernels().scale(a.ptr, float(factor), a.count, a.code, a.device, a.stream)


def cast(dst, src) -> None:
    """dst = src converted (float16, bfloat16, float32, float64; nearest even)."""
    d, s = device_array(dst, "dst"), device_array(src, "src")
    if not (d.dtype.floating and s.dtype.floating):
        raise TypeError(f"cast: floating dtypes only, got {s.dtype.name} -> {d.dtype.name}")
    if d.count != s.count:
        raise ValueError(f"cast: {s.count} elements into {d.count}")
    _same_device(d, s)
    kernels().cast(d.ptr, s.ptr, d.count, s.code, d.code, d.device, d.stream)


def copy(dst, src) -> None:
    """dst = src, byte for byte (same size, any dtypes)."""
    d, s = device_array(dst, "dst"), device_array(src, "src")
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy: dst has {d.nbytes} bytes, src {s.nbytes}")
    _same_device(d, s)
    kernels().copy(d.ptr, s.ptr, d.nbytes, d.device, d.stream)
