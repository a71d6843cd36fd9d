"""commlib/cuda/kernels.cu and wire.cu run on the CPU (cuda_on_host.cpp, compiled here with the C++
compiler): ``HostKernels`` has commlib._cuda's kernel calls on host pointers, and runs
each launch as a small grid whose threads take turns, so grid-stride loops, vector tails
and every block's share are exercised. The GPU tests compare the real launches with the
same references."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from commlib.cuda import KERNEL_DTYPES as NAMES, KERNEL_OPS as OPS, MAX_POINTERS, WIRE_FORMATS

SOURCE = Path(__file__).with_suffix(".cpp")


class Pointers(ctypes.Structure):  # kernels.cu's Sources and Targets
    _fields_ = [("p", ctypes.c_void_p * MAX_POINTERS)]


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(directory: Path) -> Path:
    library = directory / "cuda_on_host.so"
    # -Werror: GCC's warnings about these kernels have meant wrong results (aliasing)
    subprocess.run([compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror",
                    "-Wno-unknown-pragmas", "-o", str(library), str(SOURCE)],
                   check=True, capture_output=True, text=True)
    return library


class HostKernels:
    """Launches as commlib._cuda's (device and stream ignored) on a grid of ``blocks`` x
    ``threads`` CPU-run threads; odd sizes by default, so that strides do not divide."""

    def __init__(self, library: Path, blocks: int = 3, threads: int = 5):
        self.lib = ctypes.CDLL(str(library))
        self.blocks, self.threads = blocks, threads
        self._index = {name: ctypes.c_uint.in_dll(self.lib, name)
                       for name in ("blockIdx", "threadIdx", "blockDim", "gridDim")}

    def _launch(self, name: str, argtypes: list, *args) -> None:
        kernel = getattr(self.lib, name)
        kernel.argtypes, kernel.restype = argtypes, None
        index = self._index
        index["gridDim"].value, index["blockDim"].value = self.blocks, self.threads
        for block in range(self.blocks):
            for thread in range(self.threads):
                index["blockIdx"].value, index["threadIdx"].value = block, thread
                kernel(*args)

    def reduce(self, dst, a, b, count, dtype, op, device=0, stream=0) -> None:
        p = ctypes.c_void_p
        self._launch(f"commlib_reduce_{NAMES[dtype]}_{OPS[op]}", [p, p, p, ctypes.c_longlong],
                     dst, a, b, count)

    def reduce_n(self, targets, sources, count, dtype, op, device=0, stream=0) -> None:
        if not (1 <= len(targets) <= MAX_POINTERS and 1 <= len(sources) <= MAX_POINTERS):
            raise ValueError(f"reduce_n: 1 to {MAX_POINTERS} targets and sources, got "
                             f"{len(targets)} and {len(sources)}")
        self._launch(f"commlib_reduce_n_{NAMES[dtype]}_{OPS[op]}",
                     [Pointers, ctypes.c_int, Pointers, ctypes.c_int, ctypes.c_longlong],
                     Pointers((ctypes.c_void_p * MAX_POINTERS)(*targets)), len(targets),
                     Pointers((ctypes.c_void_p * MAX_POINTERS)(*sources)), len(sources), count)

    def scale(self, x, factor, count, dtype, device=0, stream=0) -> None:
        self._launch(f"commlib_scale_{NAMES[dtype]}",
                     [ctypes.c_void_p, ctypes.c_double, ctypes.c_longlong], x, factor, count)

    def cast(self, dst, src, count, src_dtype, dst_dtype, device=0, stream=0) -> None:
        p = ctypes.c_void_p
        self._launch(f"commlib_cast_{NAMES[src_dtype]}_{NAMES[dst_dtype]}",
                     [p, p, ctypes.c_longlong], dst, src, count)

    def copy(self, dst, src, nbytes, device=0, stream=0) -> None:
        p = ctypes.c_void_p
        self._launch("commlib_copy", [p, p, ctypes.c_longlong], dst, src, nbytes)

    def wire_encode(self, data, residual, packet, count, format, block, device=0,
                    stream=0) -> None:
        p = ctypes.c_void_p
        self._launch(f"commlib_wire_encode_{WIRE_FORMATS[format]}",
                     [p, p, p, ctypes.c_longlong, ctypes.c_int], data, residual or None, packet,
                     count, block)

    def wire_decode_sum(self, out, packets, count, format, block, factor=1.0, device=0,
                        stream=0) -> None:
        self._launch(f"commlib_wire_decode_sum_{WIRE_FORMATS[format]}",
                     [ctypes.c_void_p, Pointers, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                      ctypes.c_float], out, _sources(packets), len(packets), count, block,
                     factor)

    def wire_sum_encode(self, packet, residual, packets, count, format, block, factor=1.0,
                        device=0, stream=0) -> None:
        p = ctypes.c_void_p
        self._launch(f"commlib_wire_sum_encode_{WIRE_FORMATS[format]}",
                     [p, p, Pointers, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                      ctypes.c_float], packet, residual or None, _sources(packets),
                     len(packets), count, block, factor)

    def wait_counter(self, counter: int, value: int) -> None:
        """commlib_wait_counter on one thread: returns once the uint32 at ``counter`` has
        reached ``value`` (a cyclic >=)."""
        self.blocks, self.threads, shape = 1, 1, (self.blocks, self.threads)
        try:
            self._launch("commlib_wait_counter", [ctypes.c_void_p, ctypes.c_uint], counter, value)
        finally:
            self.blocks, self.threads = shape


def _sources(packets: list) -> Pointers:
    if not 1 <= len(packets) <= MAX_POINTERS:
        raise ValueError(f"1 to {MAX_POINTERS} packets, got {len(packets)}")
    return Pointers((ctypes.c_void_p * MAX_POINTERS)(*packets))
