"""Exact checks of commlib._C against numpy (and torch for one bf16 cross-check)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from commlib import _C, settings

COUNTS = [0, 1, 7, 1000, 100003]
NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BITWISE = ("band", "bor", "bxor")  # integer dtypes only
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
           "float64": np.float64, "int8": np.int8, "uint8": np.uint8, "int32": np.int32,
           "int64": np.int64}
FLOATS = ["float16", "bfloat16", "float32", "float64"]
GUARD = 8  # elements past `count` that must stay untouched


def ptr(a):
    return a.ctypes.data


# ---- bfloat16 reference, deliberately not the kernel's bit trick: pick the
# nearer of the two neighbouring bf16 values in float64, ties to even.
def bf16_to_f32(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    lo = u & np.uint32(0xFFFF0000)  # truncation towards zero
    exp = ((u >> 23) & 0xFF).astype(np.int64)
    ulp = np.ldexp(1.0, np.maximum(exp, 1) - 127 - 7)
    mag = np.abs(x.astype(np.float64))
    lo_val = np.abs(lo.view(np.float32).astype(np.float64))
    with np.errstate(invalid="ignore"):  # inf - inf for infinities: compares False, keeps lo
        d_lo, d_hi = mag - lo_val, lo_val + ulp - mag
        up = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo >> 16) & 1 == 1))
    out = ((lo >> 16) + up).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def values(dtype, a):
    """Storage array -> numbers that compare exactly (NaN == NaN, -0 == 0)."""
    return bf16_to_f32(a) if dtype == "bfloat16" else a


@np.errstate(all="ignore")  # overflow to inf and inf*0 are expected here
def reference(dtype, op, a, b):
    f = NP_OPS[op]
    if dtype == "bfloat16":
        return f32_to_bf16(f(bf16_to_f32(a), bf16_to_f32(b)))
    if dtype == "float16":  # float32 arithmetic, one rounding back to half
        return f(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return f(a, b)  # numpy integers wrap around


def assert_same(dtype, got, want, bitwise=True):
    np.testing.assert_array_equal(values(dtype, got), values(dtype, want))
    if bitwise and dtype in FLOATS:  # also sign of zero / exact pattern, NaN payload aside
        nan = np.isnan(values(dtype, want))
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}")[~nan],
                                      want.view(f"u{want.itemsize}")[~nan])


def random_data(dtype, n, rng):
    if dtype in ("float16", "float32", "float64", "bfloat16"):
        x = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 300.0], n)
        x[: min(n, 6)] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5][: min(n, 6)]
        rng.shuffle(x)
        return f32_to_bf16(x.astype(np.float32)) if dtype == "bfloat16" else x.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def padded(arr):
    """Copy of arr followed by GUARD sentinel elements."""
    out = np.empty(arr.size + GUARD, arr.dtype)
    out[: arr.size] = arr
    out.view(np.uint8)[arr.nbytes:] = 0xA5
    return out


@pytest.mark.parametrize("mode", ["out", "dst_is_a", "dst_is_b", "reduce_into"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", list(NP_OPS))
@pytest.mark.parametrize("dtype", list(STORAGE))
def test_reduce_matches_numpy(dtype, op, count, mode):
    if op in BITWISE and dtype in FLOATS:
        with pytest.raises(ValueError, match=f"bitwise op '{op}' needs an integer dtype"):
            _C.reduce(0, 0, 0, 0, _C.DTYPES[dtype], _C.OPS[op])
        return
    rng = np.random.default_rng(count * 31 + len(dtype))
    a, b = random_data(dtype, count, rng), random_data(dtype, count, rng)
    want = reference(dtype, op, a, b)
    a_buf, b_buf = padded(a), padded(b)
    dt, o = _C.DTYPES[dtype], _C.OPS[op]
    if mode == "out":
        dst = padded(np.zeros(count, a.dtype))
        _C.reduce(ptr(dst), ptr(a_buf), ptr(b_buf), count, dt, o)
    elif mode == "dst_is_a":
        dst = a_buf
        _C.reduce(ptr(dst), ptr(dst), ptr(b_buf), count, dt, o)
    elif mode == "dst_is_b":
        dst = b_buf
        _C.reduce(ptr(dst), ptr(a_buf), ptr(dst), count, dt, o)
    else:
        dst = a_buf
        _C.reduce_into(ptr(dst), ptr(b_buf), count, dt, o)
    assert_same(dtype, dst[:count], want, bitwise=op in ("sum", "prod") + BITWISE)
    assert (dst.view(np.uint8)[count * a.itemsize:] == 0xA5).all(), "wrote past count"


def test_integer_wraparound():
    cases = {"int8": ([127, -128, 100], [1, -1, 3]), "uint8": ([255, 0, 16], [1, 255, 16]),
             "int32": ([2**31 - 1, -(2**31), 65536], [1, -1, 65536]),
             "int64": ([2**63 - 1, -(2**63), 2**32], [1, -1, 2**32])}
    for dtype, (x, y) in cases.items():
        for op in ("sum", "prod"):
            a, b = np.array(x, dtype), np.array(y, dtype)
            dst = np.empty_like(a)
            _C.reduce(ptr(dst), ptr(a), ptr(b), a.size, _C.DTYPES[dtype], _C.OPS[op])
            np.testing.assert_array_equal(dst, NP_OPS[op](a, b))
    a, one = np.array([127], np.int8), np.array([1], np.int8)
    _C.reduce_into(ptr(a), ptr(one), 1, _C.DTYPES["int8"], _C.OPS["sum"])
    assert a[0] == -128


def test_float16_all_bit_patterns():
    a = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    nan = np.isnan(a)
    for op, neutral in (("sum", -0.0), ("prod", 1.0)):  # x + (-0) == x, x * 1 == x, bit for bit
        # keep b alive: ptr() holds no reference
        dst, b = np.empty_like(a), np.full_like(a, neutral)
        _C.reduce(ptr(dst), ptr(a), ptr(b), a.size, _C.DTYPES["float16"], _C.OPS[op])
        np.testing.assert_array_equal(dst.view(np.uint16)[~nan], a.view(np.uint16)[~nan])
        assert np.isnan(dst[nan]).all()
    # Rounding of float32 results back to half: every half against a spread of
    # partners (subnormals, ties, overflow to inf), versus numpy's conversion.
    partners = np.array([2**-24, -(2**-24), 2**-14, 3 * 2**-24, 0.5, 0.1, 1.0, 1 + 2**-10,
                         1000.0, 65504.0, -3.0],
                        np.float16)  # * 0.5 makes ties among subnormals
    for p in partners:
        for op in ("sum", "prod"):
            b = np.full_like(a, p)
            dst = np.empty_like(a)
            _C.reduce(ptr(dst), ptr(a), ptr(b), a.size, _C.DTYPES["float16"], _C.OPS[op])
            assert_same("float16", dst, reference("float16", op, a, b))


def test_half_and_bf16_ties_nan_inf():
    def red(dtype, x, y, op="sum"):
        a, b = np.array(x, STORAGE[dtype]), np.array(y, STORAGE[dtype])
        _C.reduce_into(ptr(a), ptr(b), a.size, _C.DTYPES[dtype], _C.OPS[op])
        return a
    # ties to even at 1.0 and at the top of the range (65520 -> inf), inf - inf, subnormal result
    h = red("float16", [1.0, 1 + 2**-10, 65504.0, 65504.0, np.inf, np.inf, 2**-14],
            [2**-11, 2**-11, 16.0, 15.0, -np.inf, 1.0, -(2**-24)])
    np.testing.assert_array_equal(h[[0, 1, 2, 3, 5, 6]],
                                  [1.0, 1 + 2**-9, np.inf, 65504.0, np.inf, 1023 * 2**-24])
    assert np.isnan(h[4])
    bf = lambda v: f32_to_bf16(np.array(v, np.float32))  # noqa: E731
    r = bf16_to_f32(red("bfloat16", bf([1.0, 1 + 2**-7, 3.3895e38, np.inf, np.nan, -2.0]),
                        bf([2**-8, 2**-8, 3.3895e38, -np.inf, 1.0, 0.5])))
    np.testing.assert_array_equal(r[[0, 1, 2, 5]], [1.0, 1 + 2**-6, np.inf, -1.5])
    assert np.isnan(r[3]) and np.isnan(r[4])
    mn = red("bfloat16", bf([1.0, np.nan]), bf([np.nan, 2.0]), op="min")
    assert np.isnan(bf16_to_f32(mn)).all()


def test_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(100003).astype(np.float32) * 100).to(torch.bfloat16)
    y = torch.from_numpy(rng.standard_normal(100003).astype(np.float32)).to(torch.bfloat16)
    for op, f in (("sum", torch.add), ("prod", torch.mul), ("min", torch.minimum),
                  ("max", torch.maximum)):
        want = f(x.float(), y.float()).to(torch.bfloat16)
        dst = torch.empty_like(x)
        _C.reduce(dst.data_ptr(), x.data_ptr(), y.data_ptr(), x.numel(), _C.DTYPES["bfloat16"],
                  _C.OPS[op])
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_scale(dtype, count):
    rng = np.random.default_rng(count)
    x = random_data(dtype, count, rng)
    for factor in (0.5, 3.7, -1e-3):
        buf = padded(x)
        _C.scale(ptr(buf), count, _C.DTYPES[dtype], factor)
        if dtype == "float64":
            want = x * factor
        else:  # float32 arithmetic, factor rounded to float32
            want = values(dtype, x).astype(np.float32) * np.float32(factor)
            want = f32_to_bf16(want) if dtype == "bfloat16" else want.astype(dtype)
        assert_same(dtype, buf[:count], want)
        assert (buf.view(np.uint8)[count * x.itemsize:] == 0xA5).all()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64"])
def test_scale_rejects_integers(dtype):
    a = np.ones(4, dtype)
    with pytest.raises(ValueError, match="scale needs a floating dtype"):
        _C.scale(ptr(a), 4, _C.DTYPES[dtype], 2.0)


def test_bad_arguments():
    a = np.ones(4, np.float32)
    p, f32, s = ptr(a), _C.DTYPES["float32"], _C.OPS["sum"]
    for dt in (-1, 8, 100):
        with pytest.raises(ValueError, match="dtype"):
            _C.reduce(p, p, p, 4, dt, s)
        with pytest.raises(ValueError, match="dtype"):
            _C.scale(p, 4, dt, 1.0)
    for op in (-1, 5):
        with pytest.raises(ValueError, match="op"):
            _C.reduce_into(p, p, 4, f32, op)
    with pytest.raises(ValueError, match="count"):
        _C.reduce(p, p, p, -1, f32, s)
    with pytest.raises(ValueError, match="count"):
        _C.scale(p, -1, f32, 1.0)
    with pytest.raises(ValueError, match="nbytes"):
        _C.copy(p, p, -1)
    with pytest.raises(ValueError, match="null"):
        _C.reduce(0, p, p, 4, f32, s)
    _C.reduce(0, 0, 0, 0, f32, s)  # count 0 touches nothing
    _C.copy(0, 0, 0)


def test_copy_overlapping():
    for shift in (10, -10, 0):
        buf = np.arange(100, dtype=np.uint8)
        want = buf.copy()
        src, dst = (0, shift) if shift >= 0 else (-shift, 0)
        want[dst:dst + 50] = buf[src:src + 50].copy()
        _C.copy(ptr(buf) + dst, ptr(buf) + src, 50)
        np.testing.assert_array_equal(buf, want)


def test_build_info():
    info = _C.build_info()
    assert info["compiler"] and "-O3" in info["cxx_flags"]
    if settings.get("COMMLIB_SIMD") == "baseline":
        assert info["simd"] == "baseline"
    else:
        assert info["simd"] in ("baseline", "avx2 (runtime dispatch)")


@pytest.mark.skipif(_C.build_info()["simd"] == "baseline",
                    reason="portable path already under test")
def test_baseline_path():
    """Re-run this file with the portable (non-AVX2) kernels forced."""
    env = dict(os.environ, COMMLIB_SIMD="baseline")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          __file__, "-k", "not baseline_path and not torch"],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_copy_where_the_destination_trails_the_source_within_a_page():
    """copy takes its own loop where the destination lies 1-31 bytes past the source modulo
    4 KiB (glibc's memmove is slow there on AMD Zen): every byte lands, none outside; and
    overlapping ranges, so placed or not, still copy as memmove does."""
    rng = np.random.default_rng(5)
    raw = np.zeros(3 << 20, np.uint8)
    first = -ptr(raw) % 4096
    for n in (2047, 2048, 2049, 4096 + 17, 65_536, (1 << 20) + 5):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        for gap in (0, 1, 16, 31, 32, 4095):
            raw[:] = 0
            at = first + 4096 + (-(-n // 4096) * 4096) + gap  # (apart from the source)
            raw[first:first + n] = src
            _C.copy(ptr(raw) + at, ptr(raw) + first, n)
            assert np.array_equal(raw[at:at + n], src), (n, gap)
            assert not raw[first + n:at].any() and not raw[at + n:].any(), (n, gap)
    for shift in (-16, -1, 1, 16, 4096 + 16):  # overlapping: memmove's result
        buf = rng.integers(0, 256, 70_000, dtype=np.uint8)
        want = buf.copy()
        lo = 8192
        want[lo + shift:lo + shift + 50_000] = buf[lo:lo + 50_000]
        _C.copy(ptr(buf) + lo + shift, ptr(buf) + lo, 50_000)
        assert np.array_equal(buf, want), shift


def test_streaming_copy_any_alignment_and_size():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 70_000, dtype=np.uint8)
    for n in (0, 1, 63, 64, 255, 256, 257, 4096 + 17, 65_000):
        for src_off, dst_off in ((0, 0), (1, 0), (0, 3), (5, 11), (16, 7)):
            dst = np.zeros(70_000, np.uint8)
            _C.copy_streaming(ptr(dst) + dst_off, ptr(src) + src_off, n)
            assert np.array_equal(dst[dst_off:dst_off + n], src[src_off:src_off + n]), (n, src_off)
            assert not dst[:dst_off].any() and not dst[dst_off + n:].any(), (n, src_off, dst_off)
