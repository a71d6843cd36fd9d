"""compare: every commlib algorithm, auto, MPI's own collective and torch gloo, side by side.

For each collective and size, repetitions interleave the implementations so machine drift
hits all alike; each reports the median over all its iterations of the max over ranks, and
is then checked once on exact data. The table gives busbw per implementation, the ratio
of commlib's best (and of auto) to the best peer (MPI or gloo), and commlib's best and
the best peer's as fractions of the bound: the busbw at which each rank would move the
bytes it must read and write at this machine's memcpy bandwidth at that size, every rank
copying at once (Spec.bound: commlib_bench/specs.py; where the ranks share one host:
across hosts the network bounds them). --json writes every number, --plot a PNG of busbw
against size with the bound drawn.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import commlib

from .harness import (Progress, iteration_times, parse_size, print_table, sizes, use_local_gpu,
                      write_json)
from .internals import _C
from .peers import Case, assign, make_peers
from .specs import DTYPES, SPECS, itemsize


def add_arguments(p):
    p.add_argument("collectives", nargs="*", default=["all_reduce"],
                   help=f"any of {', '.join(SPECS)} (default all_reduce)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-d", "--datatype", default="float32", choices=DTYPES)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per size")
    p.add_argument("--no-gloo", action="store_true", help="leave torch gloo out")
    p.add_argument("--impls", help="only these, comma-separated (auto, ring, mpi, gloo...: "
                   "commlib's by algorithm name); default every one")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the buffers live (cuda: torch CUDA tensors, the ranks' "
                        "current devices; each timed call ends with a device synchronize)")
    p.add_argument("--pages", default="numpy", choices=["numpy", "huge", "base", "region"],
                   help="host buffers as numpy allocates them (its large arrays on huge "
                        "pages, where the kernel gives them), on huge or 4 KiB pages, or "
                        "from Communicator.empty (memory every rank of the host maps)")
    p.add_argument("--fresh", action="store_true",
                   help="each rank writes its input before every timed call (untimed), as "
                        "a training step writes a gradient before reducing it: a peer then "
                        "reads it from its writer's cache, not from its own, where an "
                        "unchanged input stays after the calls before")
    p.add_argument("--json", help="write every measurement to this JSON file")
    p.add_argument("--plot", default="compare.png",
                   help="write busbw vs size to this PNG file (default compare.png; '' for none)")


def iterations_for(nbytes: int) -> int:
    """Iterations per repetition: many for small messages, a couple for large ones."""
    return int(max(2, min(50, 2e7 / max(nbytes, 1e5))))


def memcpy_gbs(nbytes: int, device: str = "cpu") -> float:
    """This machine's copy bandwidth at a size (bytes copied per second), the bound on busbw:
    host memcpy, or a device-to-device copy on the GPU."""
    reps = iterations_for(nbytes) * 4
    if device == "cpu":
        src, dst = np.ones(max(nbytes, 8), np.uint8), np.empty(max(nbytes, 8), np.uint8)
        copy = lambda: _C.copy(dst.ctypes.data, src.ctypes.data, src.size)  # noqa: E731
    else:
        import torch
        src = torch.ones(max(nbytes, 8), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy = lambda: dst.copy_(src)  # noqa: E731
    sync = device_sync(device)
    best = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            copy()
        sync()
        best.append((time.perf_counter() - start) / reps)
    return max(nbytes, 8) / float(np.median(best)) / 1e9


def device_sync(device: str):
    """What a timed call must end with to include the device's work."""
    if device == "cpu":
        return lambda: None
    import torch
    return torch.cuda.synchronize


def main(args, comm) -> int:
    n, world = comm.size, comm.mpi
    unknown = [c for c in args.collectives if c not in SPECS]
    if unknown:
        raise SystemExit(f"unknown collective(s) {unknown}; choose from {', '.join(SPECS)}")
    size_of = itemsize(args.datatype)
    sync = device_sync(args.device)
    what = args.datatype
    if args.device == "cuda":
        device = use_local_gpu(world, "compare --device cuda")
        what = f"{args.datatype} on cuda (device {device} of rank {comm.rank})"
    if args.fresh:
        what += ", each input written before every call"
    grid = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    one_host = len(set(world.allgather(MPI.Get_processor_name()))) == 1  # (else no bound)
    rows, tables, any_wrong = [], {}, False
    progress = Progress(len(grid) * len(args.collectives), comm.rank == 0)
    for name in args.collectives:
        spec = SPECS[name]
        names = ([f"commlib:{a}" for a in commlib.algorithms(name, comm)] + ["commlib:auto"]
                 + (["commlib:deterministic"] if spec.reduces else [])
                 + (["commlib:registered"] if args.device == "cuda" else []) + ["mpi"]
                 + ([] if args.no_gloo else ["gloo"]))
        if args.impls:
            wanted = set(args.impls.split(","))
            names = [m for m in names if m.split(":")[-1] in wanted or m in wanted]
        peers = make_peers(comm, names)
        op = "sum" if spec.reduces else None
        for size in grid:
            count = size // size_of - (size // size_of % n if spec.blocked else 0)
            case = Case(spec, n, comm.rank, count, args.datatype, op, device=args.device,
                        pages=args.pages, comm=comm)
            active = [p for p in peers if p.unsupported(case) is None]
            samples = {p.name: [] for p in active}
            assign(case.inp, np.zeros(len(case.inp)))
            iters = iterations_for(case.nbytes)
            write = writer(case.inp, sync) if args.fresh else None
            for rep in range(args.reps):
                for p in active:
                    samples[p.name].extend(iteration_times(
                        world, lambda p=p: (p.run(case), sync()), iters,
                        warmup=1 if rep == 0 else 0, before=write))
            for p in active:
                want = case.fill_for_check()
                p.run(case)
                checked = not (spec.rooted and spec.reduces and comm.rank != case.root
                               and getattr(p, "root_only", False))
                wrong = world.allreduce(case.wrong(want) if checked else 0)
                any_wrong |= wrong > 0
                t = float(np.median(samples[p.name]))
                busbw = case.nbytes / t / 1e9 * spec.busbw_factor(n) if t > 0 else 0.0
                rows.append({"collective": name, "size": case.nbytes, "count": count,
                             "impl": p.name, "time_us": t * 1e6, "busbw": busbw, "wrong": wrong})
            world.Barrier()  # (every rank copies at once, as in the collective)
            memcpy = world.allreduce(memcpy_gbs(case.nbytes, args.device)) / n
            rows += [{"collective": name, "size": case.nbytes, "impl": "memcpy", "busbw": memcpy},
                     {"collective": name, "size": case.nbytes, "impl": "bound",
                      "busbw": spec.bound(n, memcpy) if one_host else float("nan")}]
            progress.step(f"{name} {case.nbytes} B")
        tables[name] = [p.name for p in peers]
    if comm.rank == 0:
        _print(rows, tables, n, what)
        if args.json:
            write_json(args.json, "compare", world, rows, dtype=args.datatype, device=args.device,
                       fresh=args.fresh)
        if args.plot:
            plot(rows, tables, args.plot, n, what)
            print(f"# wrote {args.plot}")
        if any_wrong:
            print("# FAILED: some results were wrong")
    return 1 if any_wrong else 0


def writer(buf, sync):
    """A call that writes every element of ``buf`` (a numpy array or a torch tensor)."""
    fill = buf.fill_ if hasattr(buf, "fill_") else buf.fill
    return lambda: (fill(0), sync())


def _print(rows, tables, n, dtype):
    for name, impls in tables.items():
        mine = [r for r in rows if r["collective"] == name and r["impl"] in impls]
        bound = {r["size"]: r["busbw"] for r in rows
                 if r["collective"] == name and r["impl"] == "bound"}
        print(f"# compare {name}: {n} ranks, {dtype}; busbw in GB/s (median of the max over "
              f"ranks); ratios are busbw over the best peer's (mpi, gloo)")
        # (deterministic mode: auto among the rank-order algorithms, priced against auto)
        det = "commlib:deterministic" in impls
        header = (["size"] + impls + ["best", "best/peer", "auto/peer", "best/bound",
                                      "peer/bound"]
                  + (["det/auto"] if det else []) + ["#wrong"])
        table = []
        for size in sorted({r["size"] for r in mine}):
            at = {r["impl"]: r for r in mine if r["size"] == size}
            bw = {i: at[i]["busbw"] if i in at else float("nan") for i in impls}
            peer = max((bw[i] for i in ("mpi", "gloo") if i in at), default=float("nan"))
            ours = {i: v for i, v in bw.items() if i.startswith("commlib:") and v == v
                    and i != "commlib:deterministic"}
            best = max(ours, key=ours.get) if ours else "n/a"
            auto = bw.get("commlib:auto", float("nan"))
            table.append([size, *bw.values(), best.removeprefix("commlib:"),
                          ours.get(best, float("nan")) / peer if peer else float("nan"),
                          auto / peer if peer else float("nan"),
                          *(v / bound[size] if bound.get(size) else float("nan")
                            for v in (ours.get(best, float("nan")), peer)),
                          *([bw["commlib:deterministic"] / auto if auto else float("nan")]
                            if det else []),
                          sum(r["wrong"] for r in at.values())])
        print_table(header, table)
        small = min(r["size"] for r in mine)
        print(f"# time at {small} B (us): " + ", ".join(
            f"{r['impl']} {r['time_us']:.1f}" for r in mine if r["size"] == small))


def plot(rows, tables, path, n, dtype):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (commlib's 'bench' "
                         "extra), or pass --plot ''") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(tables), figsize=(7 * len(tables), 4.5), squeeze=False)
    for ax, (name, impls) in zip(axes[0], tables.items()):
        for impl in impls + ["bound"]:
            pts = sorted((r["size"], r["busbw"]) for r in rows
                         if r["collective"] == name and r["impl"] == impl and r["size"] > 0)
            if pts:
                style = dict(color="black", linestyle="--") if impl == "bound" else {}
                ax.plot(*zip(*pts), marker="." if impl != "bound" else None,
                        label=impl if impl != "bound" else "bound (memcpy)", **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{name}, {n} ranks, {dtype}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
