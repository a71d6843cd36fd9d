"""all_reduce time and busbw for every algorithm and MPI's own, side by side in one run.

    mpiexec -n 2 python bench/all_reduce_sweep.py [-b 8] [-e 64M] [-f 4] [-d float32]

Per size, repetitions interleave the algorithms so machine drift hits all alike. A
repetition times a loop of calls; its time is the max over ranks; the table shows the
median over repetitions and busbw = bytes / time * 2(n-1)/n (nccl-tests). Each algorithm's
result is checked exactly once before it is timed.
"""
import argparse
import time

import numpy as np

import commlib


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--min-bytes", type=parse_size, default=8)
    p.add_argument("-e", "--max-bytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--factor", type=int, default=4)
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("-r", "--reps", type=int, default=7)
    p.add_argument("--algos", default=",".join(commlib.algorithms("all_reduce") + ["auto"]))
    args = p.parse_args()
    comm = commlib.init()
    n, dtype = comm.size, np.dtype(args.dtype)
    algos = args.algos.split(",")
    if comm.rank == 0:
        print(f"# all_reduce, {n} ranks, {dtype.name}; time in us, busbw in GB/s; "
              f"median of {args.reps} repetitions")
        print(f"{'bytes':>10} " + " ".join(f"{a + ' us':>11} {a + ' bw':>9}" for a in algos)
              + f" {'best/native':>11}")
    size = args.min_bytes
    while size <= args.max_bytes:
        count = max(1, size // dtype.itemsize)
        nbytes = count * dtype.itemsize
        for a in algos:  # correctness first
            t = np.full(count, comm.rank + 1, dtype)
            comm.all_reduce(t, algorithm=None if a == "auto" else a)
            assert np.all(t == n * (n + 1) // 2), f"{a} gave a wrong result at {nbytes} B"
        iters = int(max(2, min(500, 3e8 / max(nbytes, 1) / n)))
        times = {a: [] for a in algos}
        t = np.zeros(count, dtype)  # zeros stay zeros: no overflow, no denormals
        for _ in range(args.reps):
            for a in algos:
                algo = None if a == "auto" else a
                comm.all_reduce(t, algorithm=algo)  # warm
                comm.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce(t, algorithm=algo)
                elapsed = (time.perf_counter() - start) / iters
                times[a].append(comm.mpi.allreduce(elapsed, op=_max()))
        if comm.rank == 0:
            med = {a: float(np.median(times[a])) for a in algos}
            bw = {a: nbytes / med[a] * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0 for a in algos}
            best = max((bw[a] for a in algos if a not in ("native", "auto")), default=0.0)
            ratio = best / bw["native"] if bw.get("native") else float("nan")
            print(f"{nbytes:>10} " + " ".join(f"{med[a] * 1e6:>11.1f} {bw[a]:>9.2f}" for a in algos)
                  + f" {ratio:>11.2f}", flush=True)
        size *= args.factor


def _max():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == "__main__":
    main()
