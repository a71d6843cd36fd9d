"""``python -m commlib_bench <collective>``: nccl-tests style sweep of one collective.

Columns: size count type redop root impl time algbw busbw #wrong. #wrong counts elements
that differ from the exact expected result after the timed loop (summed over ranks); any
makes the exit status non-zero.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import commlib

from .harness import Progress, iteration_times, parse_size, print_table, sizes, write_json
from .peers import Case, assign, make_peers
from .specs import DTYPES, OPS, SPECS, itemsize

HEADER = ["size", "count", "type", "redop", "root", "impl", "time(us)", "algbw(GB/s)",
          "busbw(GB/s)", "#wrong"]


def add_arguments(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=8 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="check the result (1) or not (0)")
    p.add_argument("-d", "--datatype", default="float32", choices=DTYPES)
    p.add_argument("-o", "--op", default="sum", choices=OPS)
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("--algo", default="auto", help="a commlib algorithm, auto, or all")
    p.add_argument("--inplace", action="store_true", help="in-place form where one exists")
    p.add_argument("--json", help="also write the results to this JSON file")


def implementations(comm, collective: str, algo: str) -> list[str]:
    if algo == "all":
        return [f"commlib:{a}" for a in commlib.algorithms(collective, comm)] + ["commlib:auto"]
    return [f"commlib:{algo}"]


def measure(peer, case, world: MPI.Comm, iters: int, warmup: int, check: bool) -> dict:
    """Time ``peer`` on ``case``; then, if asked, check one call on exact data.

    Timing runs on zeros: sums, products and extrema of zeros stay zeros (no overflow, no
    denormals), so every iteration does the same work."""
    assign(case.inp, np.zeros(len(case.inp)))
    times = iteration_times(world, lambda: peer.run(case), iters, warmup)
    wrong = 0
    if check:
        want = case.fill_for_check()
        peer.run(case)
        wrong = world.allreduce(case.wrong(want))
    return {"time": float(np.median(times)), "wrong": wrong}


def main(args, comm) -> int:
    spec = SPECS[args.command]
    n = comm.size
    if spec.rooted and not 0 <= args.root < n:
        raise SystemExit(f"--root {args.root} is outside the {n} ranks")
    size_of = itemsize(args.datatype)
    peers = make_peers(comm, implementations(comm, spec.name, args.algo))
    op = args.op if spec.reduces else None
    if op == "avg" and args.datatype.startswith(("int", "uint")):
        raise SystemExit("-o avg needs a floating datatype")
    grid = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    progress = Progress(len(grid) * len(peers), comm.rank == 0)
    rows, any_wrong = [], False
    for size in grid:
        count = size // size_of
        if spec.blocked:
            count -= count % n
        for peer in peers:
            case = Case(spec, n, comm.rank, count, args.datatype, op, args.root, args.inplace)
            reason = peer.unsupported(case)
            row = {"size": case.nbytes, "count": count, "type": args.datatype,
                   "redop": op or "none", "root": args.root if spec.rooted else -1,
                   "impl": peer.name}
            if reason:
                row.update(time=None, algbw=None, busbw=None, wrong=None, note=reason)
            else:
                r = measure(peer, case, comm.mpi, args.iters, args.warmup_iters, args.check)
                algbw = case.nbytes / r["time"] / 1e9 if r["time"] > 0 else 0.0
                row.update(time=r["time"] * 1e6, algbw=algbw, busbw=algbw * spec.busbw_factor(n),
                           wrong=r["wrong"] if args.check else None)
                any_wrong |= bool(r["wrong"])
            rows.append(row)
            progress.step(f"{peer.name} {case.nbytes} B")
    if comm.rank == 0:
        print(f"# commlib bench {spec.name}: {n} ranks, {args.datatype}, op {op or 'none'}, "
              f"{args.iters} iterations after {args.warmup_iters} warm-up; time = median over "
              f"iterations of the max over ranks; busbw factor {spec.busbw_factor(n):.3f}")
        print_table(HEADER, [[r["size"], r["count"], r["type"], r["redop"], r["root"], r["impl"],
                              _num(r["time"]), _num(r["algbw"]), _num(r["busbw"]),
                              "n/a" if r["wrong"] is None else r["wrong"]] for r in rows])
        if args.json:
            write_json(args.json, spec.name, comm.mpi, rows, dtype=args.datatype, op=op)
        if any_wrong:
            print("# FAILED: some results were wrong")
    return 1 if any_wrong else 0


def _num(v):
    return float("nan") if v is None else v
