"""The dtypes commlib communicates: Python's one table. Codes, sizes and kinds come from
the C++ extension's (csrc/kernels.h); what numpy, the CUDA array interface, the GPU
kernels and MPI call each type is derived here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _C


@dataclass(frozen=True)
class DType:
    name: str
    code: int  # _C's (csrc/kernels.h), as every C++ and CUDA call takes it
    itemsize: int
    floating: bool

    @property
    def kernel(self) -> str:
        """How kernels.cu's kernel names spell it: f32, bf16, i8, u8, ..."""
        bits = str(8 * self.itemsize)
        if self.name == "bfloat16":
            return "bf" + bits
        return ("f" if self.floating else "u" if self.name.startswith("u") else "i") + bits

    @property
    def mpi(self) -> str:
        """The MPI datatype MPI's own collectives move it as: 16-bit floats as raw 16-bit
        words (MPI has no bfloat16; our own kernels reduce them)."""
        if self.itemsize == 2 and self.floating:
            return "UINT16_T"
        return {"float32": "FLOAT", "float64": "DOUBLE"}.get(self.name, self.name.upper() + "_T")

    @property
    def numpy(self) -> np.dtype | None:
        """numpy's dtype (None for bfloat16, which numpy lacks)."""
        return None if self.name == "bfloat16" else np.dtype(self.name)


BY_CODE = tuple(DType(name, code, itemsize, floating)
                for code, (name, itemsize, floating) in enumerate(_C.DTYPE_TABLE))
DTYPES = {d.name: d for d in BY_CODE}
BY_NUMPY = {d.numpy: d for d in BY_CODE if d.numpy is not None}
# the CUDA array interface's typestrs without byte order ("f4"), for CuPy and the like
BY_TYPESTR = {d.numpy.str[1:]: d for d in BY_CODE if d.numpy is not None}
NAMES = ", ".join(DTYPES)
