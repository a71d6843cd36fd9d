"""overlap: an async all_reduce against the caller's compute (OSU osu_iallreduce method).

pure_comm = issue + wait with nothing between; a compute loop (single-threaded matmuls,
which release the GIL) is calibrated to last as long (on the slowest rank); overall =
issue, compute, wait, timed in turn with the compute alone;
overlap % = max(0, 100 - 100 (overall - compute) / pure_comm). MPI's own Iallreduce is
measured the same way, interleaved, as the anchor. A progress thread can only overlap
where a core is free for it: with as many ranks as cores, both compete for the same CPUs.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .harness import iteration_times, parse_size, print_table, sizes, write_json

_A = np.full((96, 96), 0.5)
_B = np.empty_like(_A)


def compute(units: int) -> None:
    for _ in range(units):
        np.matmul(_A, _A, out=_B)


def overlap_percent(overall: float, compute_time: float, pure_comm: float) -> float:
    """OSU's definition: the share of the communication hidden behind the compute."""
    if pure_comm <= 0:
        return 0.0
    return max(0.0, 100.0 - 100.0 * (overall - compute_time) / pure_comm)


def calibrated(world, units: int, seconds: float) -> int:
    """Compute units that take about ``seconds`` on the slowest rank (OSU sizes the compute
    to the communication's time): ``units`` scaled by what 3 runs of them took."""
    for _ in range(2):
        took = float(np.median(iteration_times(world, lambda: compute(units), 3)))
        units = max(1, round(units * seconds / max(took, 1e-9)))
    return units


def add_arguments(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=64 << 10)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=16 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=15)
    p.add_argument("--algos", default="auto,ring", help="commlib algorithms to measure")
    p.add_argument("--json")


def main(args, comm) -> int:
    world = comm.mpi

    def issue(impl, buf):
        if impl == "mpi:Iallreduce":
            return world.Iallreduce(MPI.IN_PLACE, buf).Wait
        algo = impl.split(":", 1)[1]
        return comm.all_reduce(buf, algorithm=None if algo == "auto" else algo,
                               async_op=True).wait

    impls = ["mpi:Iallreduce"] + [f"commlib:{a}" for a in args.algos.split(",")]
    compute(20)  # warm: the first products are slower
    start = time.perf_counter()
    compute(200)
    unit = world.allreduce((time.perf_counter() - start) / 200, op=MPI.MAX)
    rows = []
    for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        buf = np.zeros(max(1, size // 4), np.float32)
        pure = {i: iteration_times(world, lambda i=i: issue(i, buf)(), args.iters, 2)
                for i in impls}
        for impl in impls:
            pure_comm = float(np.median(pure[impl]))
            units = calibrated(world, max(1, round(pure_comm / unit)), pure_comm)

            def overlapped(impl=impl, units=units):
                finish = issue(impl, buf)
                compute(units)
                finish()
            # alone and overlapped in turn, so that drifts of the machine hit both alike
            alone, overall = [], []
            overlapped()
            for _ in range(args.iters):
                alone.append(iteration_times(world, lambda: compute(units), 1)[0])
                overall.append(iteration_times(world, overlapped, 1)[0])
            alone, overall = float(np.median(alone)), float(np.median(overall))
            rows.append({"size": buf.nbytes, "impl": impl, "overall": overall * 1e6,
                         "compute": alone * 1e6, "pure_comm": pure_comm * 1e6,
                         "overlap": overlap_percent(overall, alone, pure_comm)})
    if comm.rank == 0:
        print(f"# overlap: all_reduce float32, {comm.size} ranks, OSU osu_iallreduce method; "
              f"times in us, medians of {args.iters}; compute unit {unit * 1e6:.1f} us")
        print_table(["size", "impl", "Overall", "Compute", "Pure-Comm", "Overlap%"],
                    [[r["size"], r["impl"], r["overall"], r["compute"], r["pure_comm"],
                      r["overlap"]] for r in rows])
        if args.json:
            write_json(args.json, "overlap", world, rows)
    return 0
