"""latency | bandwidth | bibw: OSU osu_latency / osu_bw / osu_bibw over commlib send/recv.

Ranks 0 and 1 take part (others wait). latency: half the round-trip of a ping-pong.
bandwidth: rank 0 posts a window of 64 isends, rank 1 the matching irecvs, then a 4-byte
ack; MB/s = size * window / time. bibw: both ranks send a window and receive one at once.
"""
from __future__ import annotations

import time

import numpy as np

import commlib

from .harness import parse_size, print_table, sizes, write_json

WINDOW = 64


def add_arguments(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=0)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=4 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=100, help="iterations (fewer above 64K)")
    p.add_argument("-w", "--warmup_iters", type=int, default=10)
    p.add_argument("--json")


def _latency(comm, buf, iters, warmup):
    peer = 1 - comm.rank
    for i in range(warmup + iters):
        if i == warmup:
            start = time.perf_counter()
        if comm.rank == 0:
            comm.send(buf, peer)
            comm.recv(buf, peer)
        else:
            comm.recv(buf, peer)
            comm.send(buf, peer)
    return (time.perf_counter() - start) / iters / 2


def _window(comm, buf, iters, warmup, both: bool):
    peer, ack = 1 - comm.rank, np.zeros(1, np.int32)
    bufs = [buf.copy() for _ in range(WINDOW)]  # one buffer per in-flight receive
    for i in range(warmup + iters):
        if i == warmup:
            start = time.perf_counter()
        works = []
        if comm.rank == 0 or both:
            works += [comm.send(buf, peer, tag=1, async_op=True) for _ in range(WINDOW)]
        if comm.rank == 1 or both:
            works += [comm.recv(b, peer, tag=1, async_op=True) for b in bufs]
        commlib.wait_all(works)
        if comm.rank == 1:
            comm.send(ack, 0, tag=2)
        else:
            comm.recv(ack, 1, tag=2)
    return time.perf_counter() - start


def main(args, comm) -> int:
    if comm.size < 2:
        raise SystemExit(f"{args.command} needs 2 ranks (mpiexec -n 2)")
    pair = comm.split(0 if comm.rank < 2 else None)
    rows = []
    if pair is not None:
        for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
            buf = np.zeros(size, np.uint8)
            iters = args.iters if size <= 65536 else max(5, args.iters // 5)
            pair.barrier()
            if args.command == "latency":
                rows.append({"size": size, "latency_us": _latency(pair, buf, iters,
                                                                  args.warmup_iters) * 1e6})
            else:
                both = args.command == "bibw"
                t = _window(pair, buf, iters, args.warmup_iters, both)
                moved = size * WINDOW * iters * (2 if both else 1)
                rows.append({"size": size, "MB/s": moved / t / 1e6})
    comm.barrier()
    if comm.rank == 0:
        key = "latency_us" if args.command == "latency" else "MB/s"
        label = "Latency (us)" if args.command == "latency" else (
            "Bi-Bandwidth (MB/s)" if args.command == "bibw" else "Bandwidth (MB/s)")
        print(f"# commlib {args.command} (OSU method), ranks 0 and 1"
              + ("" if args.command == "latency" else f", window {WINDOW}"))
        print_table(["Size", label], [[r["size"], r[key]] for r in rows])
        if args.json:
            write_json(args.json, args.command, comm.mpi, rows)
    return 0
