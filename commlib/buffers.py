"""User arrays (numpy arrays, torch CPU tensors) -> Buffer: address, size, dtype, byte view."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _C


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    floating: bool

    @property
    def code(self) -> int:
        return _C.DTYPES[self.name]


DTYPES = {d.name: d for d in (
    DType("float16", 2, True), DType("bfloat16", 2, True), DType("float32", 4, True),
    DType("float64", 8, True), DType("int8", 1, False), DType("uint8", 1, False),
    DType("int32", 4, False), DType("int64", 8, False))}
_SUPPORTED = ", ".join(DTYPES)
_BY_NUMPY = {np.dtype(name): d for name, d in DTYPES.items() if name != "bfloat16"}


@dataclass(frozen=True)
class Buffer:
    obj: object        # the user's array, kept alive while we use its memory
    bytes: np.ndarray  # flat uint8 view of the same memory (what MPI sends)
    ptr: int
    numel: int
    dtype: DType

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def part(self, offset: int, count: int) -> "Buffer":
        """Elements [offset, offset + count) of this buffer."""
        size = self.dtype.itemsize
        return Buffer(self.obj, self.bytes[offset * size:(offset + count) * size],
                      self.ptr + offset * size, count, self.dtype)

    def overlaps(self, other: "Buffer") -> bool:
        return (self.nbytes > 0 and other.nbytes > 0 and self.ptr < other.ptr + other.nbytes
                and other.ptr < self.ptr + self.nbytes)


def scratch(numel: int, dtype: DType) -> Buffer:
    """A new buffer of ``numel`` elements of ``dtype`` (contents undefined)."""
    raw = np.empty(numel * dtype.itemsize, np.uint8)
    return Buffer(raw, raw, raw.ctypes.data, numel, dtype)


def as_buffer(obj, name: str = "tensor", writable: bool = True) -> Buffer:
    """Validate ``obj`` and describe its memory; raise TypeError/ValueError naming ``name``."""
    if isinstance(obj, np.ndarray):
        dtype = _BY_NUMPY.get(obj.dtype)
        if dtype is None:
            raise TypeError(f"{name}: dtype {obj.dtype} is not supported; use one of {_SUPPORTED}")
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} is not contiguous; pass np.ascontiguousarray({name}) "
                             f"(the torch equivalent is {name}.contiguous())")
        if writable and not obj.flags.writeable:
            raise ValueError(f"{name} is read-only but receives data; pass a writable copy")
        flat = obj.reshape(-1)
        return Buffer(obj, flat.view(np.uint8), obj.__array_interface__["data"][0], obj.size,
                      dtype)
    if type(obj).__module__.startswith("torch"):
        return _torch_buffer(obj, name)
    raise TypeError(f"{name}: expected a numpy array or a torch CPU tensor, got {type(obj).__name__}")


def _torch_buffer(t, name: str) -> Buffer:
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a numpy array or a torch CPU tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; this commlib build handles CPU tensors only")
    dtype = DTYPES.get(str(t.dtype).removeprefix("torch."))
    if dtype is None:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {_SUPPORTED}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; call {name}.contiguous() first")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:  # torch refuses to reinterpret some empty views
        return Buffer(t, np.empty(0, np.uint8), flat.data_ptr(), 0, dtype)
    return Buffer(t, flat.view(torch.uint8).numpy(), flat.data_ptr(), flat.numel(), dtype)
