"""kernels.cu compiled at run time by NVRTC through CuPy, for an install built without
nvcc: the same calls as commlib._cuda. Importing this module fails without CuPy."""
import math

import cupy
import numpy as np

from . import ITEMSIZES, source

_DTYPES = ("f16", "bf16", "f32", "f64", "i8", "u8", "i32", "i64")  # kernel names' spelling
_OPS = ("sum", "prod", "min", "max", "sum")  # avg reduces as sum
_THREADS = 256  # as csrc/cuda/launch.cu


class NvrtcKernels:
    def __init__(self):
        self.BUILD_INFO = {"cuda_version": str(cupy.cuda.runtime.runtimeGetVersion()),
                           "compiled_by": "nvrtc (cupy)"}
        self._module = cupy.RawModule(code=source(), options=("-std=c++17",))

    @staticmethod
    def device_count() -> int:
        try:
            return cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError:
            return 0

    def _launch(self, name, work, args, device, stream):
        if work <= 0:
            return
        with cupy.cuda.Device(device):
            sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
            blocks = max(1, min(math.ceil(work / _THREADS), 8 * sms))
            self._module.get_function(name)((blocks,), (_THREADS,), args,
                                            stream=cupy.cuda.ExternalStream(stream))

    def reduce(self, dst, a, b, count, dtype, op, device, stream):
        work = math.ceil(count * ITEMSIZES[dtype] / 16)
        self._launch(f"commlib_reduce_{_DTYPES[dtype]}_{_OPS[op]}", work,
                     (np.uint64(dst), np.uint64(a), np.uint64(b), np.int64(count)), device, stream)

    def reduce_n(self, dst, sources, count, dtype, op, device, stream):
        if not 1 <= len(sources) <= 16:
            raise ValueError(f"reduce_n: 1 to 16 sources, got {len(sources)}")
        # the kernel's Sources parameter, by value: CuPy passes a structured scalar as a struct
        table = np.zeros(1, dtype=[("p", np.uint64, 16)])[0]
        table["p"][:len(sources)] = sources
        work = math.ceil(count * ITEMSIZES[dtype] / 16)
        self._launch(f"commlib_reduce_n_{_DTYPES[dtype]}_{_OPS[op]}", work,
                     (np.uint64(dst), table, np.int32(len(sources)), np.int64(count)), device, stream)

    def scale(self, x, factor, count, dtype, device, stream):
        self._launch(f"commlib_scale_{_DTYPES[dtype]}", math.ceil(count * ITEMSIZES[dtype] / 16),
                     (np.uint64(x), np.float64(factor), np.int64(count)), device, stream)

    def cast(self, dst, src, count, src_dtype, dst_dtype, device, stream):
        wider = max(ITEMSIZES[src_dtype], ITEMSIZES[dst_dtype])
        self._launch(f"commlib_cast_{_DTYPES[src_dtype]}_{_DTYPES[dst_dtype]}",
                     math.ceil(count * wider / 16),
                     (np.uint64(dst), np.uint64(src), np.int64(count)), device, stream)

    def copy(self, dst, src, nbytes, device, stream):
        self._launch("commlib_copy", math.ceil(nbytes / 16),
                     (np.uint64(dst), np.uint64(src), np.int64(nbytes)), device, stream)
