"""Kernels: commlib._C reduce and copy vs numpy and memcpy on the same arrays (one process).

    python -m commlib_bench kernels [--reps 21]

Reduce GB/s counts bytes read + written (3 * n * itemsize: read dst, read src,
write dst); copies count 2 * n * itemsize. Times are medians over --reps
interleaved samples; small arrays run many calls per sample so timer overhead
stays small.
"x numpy" is numpy's time / this row's time (>1 means faster than numpy);
"% copy" is this row's GB/s relative to _C.copy on the same size. "copy+16" copies to a
destination 16 bytes past the source modulo 4 KiB (see csrc/kernels.cpp's copy). The wire
rows are the compressed collectives' kernels (commlib/compressed.py).
"""
import statistics
import time

import numpy as np

from commlib.compressed import Wire

from .internals import _C

SUM = _C.OPS["sum"]


def median_seconds(fns, nbytes, reps):
    """Median seconds per call of each fn. Samples are interleaved (every fn
    once per round) so drifting machine load hits all rows alike."""
    inner = max(1, (4 << 20) // nbytes)  # ~4 MiB of traffic per sample for in-cache sizes
    samples = [[] for _ in fns]
    for fn in fns:
        fn()  # warm up: page faults, caches
    for _ in range(reps):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) / inner)
    return [statistics.median(x) for x in samples]


def bench_size(nbytes_per_array, reps):
    rng = np.random.default_rng(0)
    n = nbytes_per_array // 4
    f32 = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    f16 = [x.astype(np.float16) for x in rng.standard_normal((2, 2 * n))]
    bf16 = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in f32 * 2][:2]
    bf16 = [np.concatenate([x, x]) for x in bf16]  # same byte size as f16
    (a, b), (ha, hb), (ba, bb) = f32, f16, bf16
    pa, pb, pha, phb, pba, pbb = (x.ctypes.data for x in (a, b, ha, hb, ba, bb))
    nb = a.nbytes
    # a destination 16 bytes past the source modulo 4 KiB (numpy arrays allocated one
    # after the other often lie so), where glibc's memmove is slow on AMD Zen (kernels.cpp)
    raw = np.zeros(2 * nb + 3 * 4096, np.uint8)
    first = -raw.ctypes.data % 4096
    src16 = raw[first:first + nb]
    dst16 = raw[first + -(-nb // 4096) * 4096 + 4096 + 16:][:nb]
    psrc16, pdst16 = src16.ctypes.data, dst16.ctypes.data
    rows = [  # (name, callable, elements, bytes moved, numpy baseline row name)
        ("f32 sum  _C.reduce_into", lambda: _C.reduce_into(pb, pa, n, _C.DTYPES["float32"], SUM),
         n, 3 * nb, "f32 sum  np.add(out=)"),
        ("f32 sum  np.add(out=)", lambda: np.add(a, b, out=b), n, 3 * nb, None),
        ("copy     _C.copy", lambda: _C.copy(pb, pa, nb), n, 2 * nb, "copy     np.copyto"),
        ("copy     np.copyto", lambda: np.copyto(b, a), n, 2 * nb, None),
        ("copy+16  _C.copy", lambda: _C.copy(pdst16, psrc16, nb), n,
         2 * nb, "copy+16  np.copyto"),
        ("copy+16  np.copyto", lambda: np.copyto(dst16, src16), n, 2 * nb, None),
        ("f16 sum  _C.reduce_into",
         lambda: _C.reduce_into(phb, pha, 2 * n, _C.DTYPES["float16"], SUM),
         2 * n, 3 * nb, "f16 sum  np.add(out=)"),
        ("f16 sum  np.add(out=)", lambda: np.add(ha, hb, out=hb), 2 * n, 3 * nb, None),
        ("bf16 sum _C.reduce_into",
         lambda: _C.reduce_into(pbb, pba, 2 * n, _C.DTYPES["bfloat16"], SUM),
         2 * n, 3 * nb, None),
        *wire_rows(a, b),
    ]
    times = dict(zip([r[0] for r in rows], median_seconds([r[1] for r in rows], nb, reps)))
    copy_gbs = 2 * nb / times["copy     _C.copy"] / 1e9
    size = f"{nb >> 10} KiB" if nb < 1 << 20 else f"{nb >> 20} MiB"
    for name, _, elems, moved, base in rows:
        t = times[name]
        gbs = moved / t / 1e9
        vs_np = f"{times[base] / t:7.2f}" if base else "      -"
        print(f"{size:>7} | {name:<24} | {t * 1e6:10.1f} | {gbs:7.1f} | {elems / t / 1e9:7.2f} | "
              f"{vs_np} | {100 * gbs / copy_gbs:6.0f}%")


def wire_rows(data, residual):
    """The compressed collectives' kernels (csrc/wire.h) on float32 ``data``: encoding
    with error feedback (reads data and residual, writes residual and packet), and the
    owner's step of an all_reduce, two packets decoded, summed and encoded again with its
    residual in one pass (reads the packets and the residual, writes both); bytes as they
    move."""
    rows = []
    n = data.size
    for fmt in ("bf16", "int8", "fp8_e4m3"):
        wire = Wire(fmt, 64)
        packets = [wire.encode(data) for _ in range(3)]  # two summed, one written
        p = wire.packet_bytes(n)
        pd, pr = data.ctypes.data, residual.ctypes.data
        pp = [x.ctypes.data for x in packets]
        rows += [
            # (each lambda holds the arrays it addresses: the next format's rebinds them)
            (f"{fmt:<8} encode+ef", lambda pd=pd, pr=pr, w=wire, out=pp[0], keep=packets:
                _C.wire_encode(pd, pr, out, n, w.code, w.block), n, 12 * n + p, None),
            (f"{fmt:<8} sum2+encode", lambda w=wire, pp=pp, pr=pr, keep=packets:
                _C.wire_sum_encode(pp[2], pr, pp[:2], n, w.code, w.block, 1.0),
             n, 3 * p + 8 * n, None),
        ]
    return rows


def add_arguments(p):
    p.add_argument("--reps", type=int, default=21)


def main(args):
    info = _C.build_info()
    print(f"commlib._C: {info['compiler']}, flags '{info['cxx_flags']}', simd: {info['simd']}; "
          f"numpy {np.__version__}")
    print(f"{'size':>7} | {'kernel':<24} | {'median us':>10} | {'GB/s':>7} | {'Gelem/s':>7} | "
          "x numpy | % copy")
    print("-" * 88)
    for nbytes in (32 << 10, 1 << 20, 64 << 20):
        bench_size(nbytes, args.reps)

