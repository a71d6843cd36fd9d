"""GPU kernels: commlib.cuda reduce, scale, cast and copy vs a device-to-device copy (one process).

    python -m commlib_bench gpu-kernels [--sizes 64M,256M] [--reps 21]

GB/s counts bytes read + written: reduce 3 * n * itemsize (read a and b, write dst),
copies 2 * nbytes, scale 2 * nbytes, cast n * (source + target itemsize). "% copy" is a
row's GB/s relative to torch's copy_ (cudaMemcpy device to device) on arrays of the same
byte size; issue 9 asks reduce for >= 90% in float32 and bfloat16 at >= 64 MiB. Times are
medians over --reps samples, each timed with CUDA events around a few calls.
"""
import statistics

from commlib import cuda

from .harness import parse_size


def median_ms(torch, fn, reps: int, inner: int = 5) -> float:
    fn()  # warm up (and compile, for the NVRTC path)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def bench_size(torch, nbytes: int, reps: int) -> None:
    def arrays(dtype):
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        return [torch.randn(n, device="cuda").to(dtype) for _ in range(3)]
    f32, bf16, f16 = arrays(torch.float32), arrays(torch.bfloat16), arrays(torch.float16)
    n32 = f32[0].numel()
    rows = [  # (name, call, bytes moved)
        ("copy     torch copy_", lambda: f32[2].copy_(f32[0]), 2 * nbytes),
        ("copy     commlib", lambda: cuda.copy(f32[2], f32[0]), 2 * nbytes),
        ("f32 sum  reduce", lambda: cuda.reduce(f32[2], f32[0], f32[1]), 3 * nbytes),
        ("bf16 sum reduce", lambda: cuda.reduce(bf16[2], bf16[0], bf16[1]), 3 * nbytes),
        ("f16 sum  reduce", lambda: cuda.reduce(f16[2], f16[0], f16[1]), 3 * nbytes),
        ("f32 max  reduce", lambda: cuda.reduce(f32[2], f32[0], f32[1], "max"), 3 * nbytes),
        ("f32 sum  torch add", lambda: torch.add(f32[0], f32[1], out=f32[2]), 3 * nbytes),
        ("f32      scale", lambda: cuda.scale(f32[2], 0.5), 2 * nbytes),
        # every float32 element to or from bfloat16: nbytes on one side, half on the other
        ("f32>bf16 cast", lambda: cuda.cast(bf16[2][:n32], f32[0]), 3 * nbytes // 2),
        ("bf16>f32 cast", lambda: cuda.cast(f32[2], bf16[0][:n32]), 3 * nbytes // 2),
    ]
    times = [median_ms(torch, fn, reps) for _, fn, _ in rows]
    copy_gbs = rows[0][2] / times[0] / 1e6
    size = f"{nbytes >> 20} MiB"
    for (name, _, moved), ms in zip(rows, times):
        gbs = moved / ms / 1e6
        print(f"{size:>8} | {name:<20} | {ms * 1e3:10.1f} | {gbs:8.1f} | "
              f"{100 * gbs / copy_gbs:6.1f}%", flush=True)


def add_arguments(p):
    p.add_argument("--sizes", default="64M,256M", help="bytes per array, comma-separated")
    p.add_argument("--reps", type=int, default=21)


def main(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("gpu-kernels needs a CUDA device (torch.cuda.is_available() is False)")
        return 1
    info = cuda.build_info()
    print(f"{torch.cuda.get_device_name()}; commlib kernels compiled by {info['compiled_by']}, "
          f"CUDA {info.get('cuda_version')}; torch {torch.__version__}")
    print(f"{'size':>8} | {'kernel':<20} | {'median us':>10} | {'GB/s':>8} | % copy")
    print("-" * 66)
    for size in args.sizes.split(","):
        bench_size(torch, parse_size(size), args.reps)
    return 0
