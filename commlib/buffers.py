"""User arrays -> Buffer: address, size, dtype, byte view. numpy arrays and torch CPU tensors
are host memory; torch CUDA tensors and __cuda_array_interface__ arrays (CuPy) are device
memory (commlib.cuda describes them, imported only when one is seen)."""
from __future__ import annotations

import sys

import numpy as np

from . import _C
from .dtypes import BY_NUMPY, DTYPES, NAMES, DType


class Buffer:
    """A user array's memory: address, element count, dtype; ``bytes`` is a flat uint8
    numpy view of it (what MPI sends), made on first use. ``device``: None for host
    memory, else the cuda.DeviceArray (device, stream, ...) it lives in."""

    __slots__ = ("obj", "ptr", "numel", "dtype", "_bytes", "device")

    def __init__(self, obj, ptr: int, numel: int, dtype: DType, bytes_view=None, device=None):
        self.obj = obj  # the user's array, kept alive while we use its memory
        self.ptr, self.numel, self.dtype, self._bytes = ptr, numel, dtype, bytes_view
        self.device = device

    @property
    def bytes(self) -> np.ndarray:
        if self._bytes is None:
            if self.device is not None:
                raise RuntimeError("device memory has no host bytes; stage it first")
            self._bytes = _flat_bytes(self.obj, self.numel)
        return self._bytes

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def part(self, offset: int, count: int) -> "Buffer":
        """Elements [offset, offset + count) of this buffer."""
        size = self.dtype.itemsize
        view = (None if self.device is not None
                else self.bytes[offset * size:(offset + count) * size])
        return Buffer(self.obj, self.ptr + offset * size, count, self.dtype, view, self.device)

    def overlaps(self, other: "Buffer") -> bool:
        return (self.nbytes > 0 and other.nbytes > 0 and self.ptr < other.ptr + other.nbytes
                and other.ptr < self.ptr + self.nbytes)


def _flat_bytes(obj, numel: int) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj.reshape(-1).view(np.uint8)
    flat = obj.detach().reshape(-1)  # a torch tensor
    if numel == 0:  # torch refuses to reinterpret some empty views
        return np.empty(0, np.uint8)
    if flat.stride(0) != 1:  # a single element keeps any stride; torch's view() needs 1
        flat = flat.as_strided((numel,), (1,))
    import torch
    return flat.view(torch.uint8).numpy()


def as_buffer(obj, name: str = "tensor", writable: bool = True) -> Buffer:
    """Validate ``obj`` and describe its memory; raise TypeError/ValueError naming ``name``."""
    if isinstance(obj, Buffer):
        return obj
    info = _C.array_info(obj)
    if info is not None:  # a numpy array
        ptr, contiguous, can_write = info
        dtype = BY_NUMPY.get(obj.dtype)
        if dtype is None:
            raise TypeError(f"{name}: dtype {obj.dtype} is not supported; use one of {NAMES}")
        if not contiguous:
            raise ValueError(f"{name} is not contiguous; pass np.ascontiguousarray({name}) "
                             f"(the torch equivalent is {name}.contiguous())")
        if writable and not can_write:
            raise ValueError(f"{name} is read-only but receives data; pass a writable copy")
        return Buffer(obj, ptr, obj.size, dtype)
    torch = sys.modules.get("torch")  # (a tensor exists only once torch is imported)
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_buffer(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _device_buffer(obj, name)
    raise TypeError(f"{name}: expected a numpy array or a torch tensor (CPU or CUDA), or a "
                    f"CuPy array, got {type(obj).__name__}")


_fast_path_takes_torch = False


def _take_torch(torch) -> None:
    """Let the fast path (csrc/fast_path.cpp) take plain CPU tensors from now on."""
    global _fast_path_takes_torch
    codes = {getattr(torch, d.name): d.code for d in DTYPES.values()}
    _C.take_torch((torch.Tensor, torch.nn.Parameter), codes, torch.strided)
    _fast_path_takes_torch = True


def _device_buffer(obj, name: str) -> Buffer:
    from . import cuda
    array = cuda.device_array(obj, name)
    return Buffer(obj, array.ptr, array.count, array.dtype, device=array)


def _torch_buffer(t, name: str) -> Buffer:
    import torch
    if not _fast_path_takes_torch:
        _take_torch(torch)
    if t.device.type == "cuda":
        return _device_buffer(t, name)
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; commlib handles CPU and CUDA tensors")
    if t.is_nested:
        raise ValueError(f"{name} is a nested tensor; pass its {name}.values()")
    if t.layout != torch.strided:  # sparse, mkldnn: no flat memory to communicate
        raise ValueError(f"{name} has layout {t.layout}; pass {name}.to_dense()")
    dtype = DTYPES.get(str(t.dtype).removeprefix("torch."))
    if dtype is None:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {NAMES}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call {name}.contiguous() first")
    return Buffer(t, t.data_ptr(), t.numel(), dtype)
