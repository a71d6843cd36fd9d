"""Overlap of an asynchronous all_reduce with the caller's compute (OSU osu_iallreduce method).

    mpiexec -n 2 python bench/overlap.py [-b 4K] [-e 16M] [-f 4] [--algos auto,ring]

Per size and implementation: pure_comm = issue + wait with nothing in between; a compute
loop (single-threaded matmuls, which release the GIL) is calibrated to last as long;
overall = issue, compute, wait. overlap % = max(0, 100 - 100 (overall - compute) / pure_comm).
MPI's own Iallreduce is measured the same way in the same run, as the anchor. Times are
the max over ranks, median over repetitions, interleaved across implementations.
"""
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # the compute must not grab other cores
import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import commlib  # noqa: E402

# One compute unit: a small single-threaded matmul. BLAS releases the GIL for the whole
# product, like the framework ops a training step overlaps with its collectives.
A = np.full((96, 96), 0.5)
B = np.empty_like(A)


def compute(units: int) -> None:
    for _ in range(units):
        np.matmul(A, A, out=B)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--min-bytes", type=parse_size, default=4096)
    p.add_argument("-e", "--max-bytes", type=parse_size, default=16 << 20)
    p.add_argument("-f", "--factor", type=int, default=4)
    p.add_argument("-r", "--reps", type=int, default=15)
    p.add_argument("--algos", default="auto,ring")
    args = p.parse_args()
    comm = commlib.init()
    world = comm.mpi

    def issue(impl, buf):
        if impl == "MPI_Iallreduce":
            req = world.Iallreduce(MPI.IN_PLACE, buf)
            return req.Wait
        work = comm.all_reduce(buf, algorithm=None if impl == "auto" else impl, async_op=True)
        return work.wait

    def timed(fn):
        comm.barrier()
        start = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - start, op=MPI.MAX)

    impls = ["MPI_Iallreduce"] + args.algos.split(",")
    start = time.perf_counter()
    compute(2000)
    unit_seconds = (time.perf_counter() - start) / 2000
    unit_seconds = world.allreduce(unit_seconds, op=MPI.MAX)
    if comm.rank == 0:
        print(f"# all_reduce overlap, {comm.size} ranks, float32, OSU osu_iallreduce method; "
              f"times in us (median of {args.reps}); compute unit {unit_seconds * 1e6:.1f} us")
        print(f"{'bytes':>10} {'impl':>15} {'Overall':>10} {'Compute':>10} {'Pure-Comm':>10} "
              f"{'Overlap%':>9}")
    size = args.min_bytes
    while size <= args.max_bytes:
        buf = np.zeros(size // 4, np.float32)
        pure = {i: [] for i in impls}
        for _ in range(args.reps):
            for impl in impls:
                issue(impl, buf)()  # warm
                pure[impl].append(timed(lambda: issue(impl, buf)()))
        rows = {}
        for impl in impls:
            pure_comm = float(np.median(pure[impl]))
            units = max(1, round(pure_comm / unit_seconds))
            rows[impl] = (units, pure_comm, [], [])
        for _ in range(args.reps):
            for impl in impls:
                units, _, overall, alone = rows[impl]
                alone.append(timed(lambda: compute(units)))

                def overlapped():
                    finish = issue(impl, buf)
                    compute(units)
                    finish()
                overall.append(timed(overlapped))
        if comm.rank == 0:
            for impl in impls:
                _, pure_comm, overall, alone = rows[impl]
                o, c = float(np.median(overall)), float(np.median(alone))
                pct = max(0.0, 100 - 100 * (o - c) / pure_comm)
                print(f"{size:>10} {impl:>15} {o * 1e6:>10.1f} {c * 1e6:>10.1f} "
                      f"{pure_comm * 1e6:>10.1f} {pct:>9.1f}", flush=True)
        size *= args.factor


if __name__ == "__main__":
    main()
