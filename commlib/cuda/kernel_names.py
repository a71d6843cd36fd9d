"""What the GPU kernels are called and take, as kernels.cu and wire.cu name them: the
dtypes and ops by code, the wire formats, the most pointers a kernel takes, and the source
both compilers see. The GPU path's modules (runtime.py, registered.py) read them here, not
from the package, which imports those modules.
"""
from pathlib import Path

from .. import _C
from ..dtypes import BY_CODE

# names by code, as commlib.dtypes and _C have them (kernels.cu's kernels are named by the
# dtypes' `kernel` spellings; avg reduces as sum, then scales)
DTYPES = tuple(d.name for d in BY_CODE)
FLOATING = tuple(d.name for d in BY_CODE if d.floating)
# the ops kernels.cu has (no bitwise ones: calls with those are staged through host memory);
# each one's index is its code, the bitwise codes coming last
OPS = tuple(op for op in _C.OPS if op not in ("band", "bor", "bxor"))
KERNEL_DTYPES = tuple(d.kernel for d in BY_CODE)
KERNEL_OPS = tuple("sum" if op == "avg" else op for op in OPS)
# the wire formats (commlib.compressed) by code: wire.cu's kernels are named by them
WIRE_FORMATS = tuple(sorted(_C.WIRE_FORMATS, key=_C.WIRE_FORMATS.get))


def source() -> str:
    """The kernels' CUDA C++ source, as both compilers see it: kernels.cu, then the wire
    formats' (wire.cu)."""
    here = Path(__file__).parent
    return (here / "kernels.cu").read_text() + (here / "wire.cu").read_text()


# reduce_n's targets and sources at most: kernels.cu's kMaxPointers and gpu_proxy.h's
# kMaxRanks (tests/test_cuda.py checks all three agree)
MAX_POINTERS = 16
