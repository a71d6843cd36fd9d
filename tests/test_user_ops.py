"""User-defined reduce ops (commlib/user_ops.py, csrc/user_ops.h) in one process: the compiled
kernels against numpy on every dtype and aliasing, and the errors. tests/mpi/matrix.py runs
them through every algorithm at 1-4 ranks."""
import numpy as np
import pytest

import commlib
from commlib import _C
from commlib.dtypes import DTYPES


def clipped_sum(a, b):
    return min(a + b, 100)


def reference(a, b):
    return np.minimum(a + b, 100)


OP = commlib.ReduceOp.define(clipped_sum, list(DTYPES))


def _arrays(dtype, count, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 60, count).astype(np.float64)
    if dtype == "bfloat16":  # stored as the top 16 bits of a float32 (exact for small ints)
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), x
    return x.astype(dtype), x


def _as_f64(arr, dtype):
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return arr.astype(np.float64)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("count", [0, 1, 255, 257, 10_001])
def test_kernel_matches_numpy_every_aliasing(dtype, count):
    (a, fa), (b, fb) = _arrays(dtype, count, 1), _arrays(dtype, count, 2)
    want = reference(fa, fb)
    code = DTYPES[dtype].code
    out = np.empty_like(a)
    _C.reduce(out.ctypes.data, a.ctypes.data, b.ctypes.data, count, code, OP.code)  # apart
    np.testing.assert_array_equal(_as_f64(out, dtype), want)
    for into_a in (True, False):  # dst is a (into), dst is b (into, operands swapped)
        x, y = a.copy(), b.copy()
        dst = x if into_a else y
        _C.reduce(dst.ctypes.data, x.ctypes.data, y.ctypes.data, count, code, OP.code)
        np.testing.assert_array_equal(_as_f64(dst, dtype), want)


def test_same_definition_same_code_and_errors():
    again = commlib.ReduceOp.define(clipped_sum, list(DTYPES))
    assert again is OP and OP.code >= _C.FIRST_USER_OP
    assert commlib.ReduceOp.parse(OP) is OP and OP.name == "clipped_sum"
    only_bf16 = commlib.ReduceOp.define(clipped_sum, "bfloat16", name="clipped_bf16")
    (a, fa), (b, fb) = _arrays("bfloat16", 300, 1), _arrays("bfloat16", 300, 2)
    _C.reduce(a.ctypes.data, a.ctypes.data, b.ctypes.data, 300, DTYPES["bfloat16"].code,
              only_bf16.code)  # (through float32, though float32 itself is not declared)
    np.testing.assert_array_equal(_as_f64(a, "bfloat16"), reference(fa, fb))
    other = commlib.ReduceOp.define(lambda a, b: a * b, "float32", name="product")
    assert other.code != OP.code and other.dtypes == ("float32",)
    x = np.ones(4, np.int32)
    with pytest.raises(ValueError, match="'product' is not defined for int32"):
        _C.reduce(x.ctypes.data, x.ctypes.data, x.ctypes.data, 4, DTYPES["int32"].code,
                  other.code)
    with pytest.raises(ValueError, match="never defined"):
        _C.reduce(x.ctypes.data, x.ctypes.data, x.ctypes.data, 4, DTYPES["int32"].code,
                  _C.FIRST_USER_OP + 12345)
    with pytest.raises(ValueError, match="unknown dtype"):
        commlib.ReduceOp.define(clipped_sum, "complex64")
    with pytest.raises(TypeError, match="numba cannot compile 'adds_a_string'"):
        def adds_a_string(a, b):
            return a + "b"
        commlib.ReduceOp.define(adds_a_string, "float32")
    with pytest.raises(TypeError, match="Python function"):
        commlib.ReduceOp.define(np.add, "float32")
    with pytest.raises(ValueError, match="ReduceOp.define"):
        commlib.ReduceOp.parse("clipped_sum")  # ops are passed as objects, not names
