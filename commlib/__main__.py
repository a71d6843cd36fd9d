"""A short multi-rank demonstration: ``mpiexec -n 4 python -m commlib``."""
import time

import numpy as np

import commlib
from commlib.transports.mpi_world import allgather


def main():
    comm = commlib.init()
    rank, n = comm.rank, comm.size
    t = np.arange(4, dtype=np.float32) + rank
    comm.all_reduce(t)
    gathered = np.empty(n, np.int64)
    comm.all_gather(gathered, np.array([rank * rank]))
    halves = comm.split(rank % 2)
    s = np.array([float(rank)])
    halves.all_reduce(s, op="max")
    lines = allgather(comm.mpi, f"rank {rank}/{n}: all_reduce {t.tolist()}  all_gather "
                                f"{gathered.tolist()}  max over my half {s[0]:.0f}")
    big = np.ones(1 << 20, np.float32)
    timings = {}
    for algo in comm.algorithms("all_reduce"):
        comm.all_reduce(big, algorithm=algo)
        comm.barrier()
        start = time.perf_counter()
        for _ in range(5):
            comm.all_reduce(big, algorithm=algo)
        timings[algo] = max(allgather(comm.mpi, (time.perf_counter() - start) / 5))
    if rank == 0:
        print("\n".join(lines))
        print(f"commlib {commlib.build_info().get('simd', '')}; all_reduce of 4 MiB float32:")
        for algo, sec in timings.items():
            busbw = big.nbytes / sec * 2 * (n - 1) / n / 1e9
            print(f"  {algo:>7}: {sec * 1e3:7.2f} ms  busbw {busbw:5.2f} GB/s")


if __name__ == "__main__":
    main()
