"""calibrate: fit the cost model's constants to this machine; write the tuning file; and
measure the algorithm table that auto uses (commlib/tuning.py) again.

Each algorithm prices itself as terms linear in the constants (commlib/algorithms/:
rounds*alpha + moved*beta + reduced*gamma on MPI, their shared-memory counterparts, MPI's
own rounds*alpha_native + moved*per_byte[collective]), so measured times give a
least-squares problem, weighted by 1/time so that small messages count as much as large
ones, with non-negative solutions. Prints predicted vs measured for every measurement so
the model's error is visible.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import commlib

from .harness import iteration_times, parse_size, print_table, sizes
from .internals import COLLECTIVES, CostModel, Where, default_model, entries, tuning_path
from .peers import Case, CommlibPeer
from .specs import SPECS


def add_arguments(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=64)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=4 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("--out", help=f"tuning file to write (default: ${'COMMLIB_TUNING'} or "
                                 f"{tuning_path()})")
    p.add_argument("--dry-run", action="store_true", help="fit and print, write nothing")


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0: drop the most negative coefficient and refit until none is."""
    free = np.ones(X.shape[1], bool)
    while True:
        x = np.zeros(X.shape[1])
        x[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        if (x >= 0).all():
            return x
        free[np.argmin(np.where(free, x, np.inf))] = False


def fitted_constants(samples, transport: str = "mpi", base: CostModel | None = None):
    """(the constants the samples' terms use, each sample's terms)."""
    model, where = base or CostModel(), Where(transport)
    rows = [(entries(c)[a].cost(model, where, n, b), t) for c, a, n, b, t in samples
            if a != "hier"]  # (hier mixes its stages' constants)
    names = sorted({k for terms, _ in rows for k, v in terms.items() if v})
    return names, rows


def fit(samples, transport: str = "mpi", base: CostModel | None = None) -> CostModel:
    """samples: (collective, algorithm, n, nbytes, seconds) -> ``base`` (default: the
    built-in constants) with the constants the samples' algorithms use on ``transport``
    fitted. Constants without data keep their values."""
    model = base or CostModel()
    names, rows = fitted_constants(samples, transport, model)
    if not rows:
        return model
    X = np.array([[terms.get(k, 0) for k in names] for terms, _ in rows], float)
    y = np.array([t for _, t in rows])
    w = 1 / y
    fitted = dict(zip(names, nnls(X * w[:, None], y * w)))
    per_byte = dict(model.native_per_byte)
    per_byte.update({k.removeprefix("native:"): v for k, v in fitted.items()
                     if k.startswith("native:")})
    return dataclasses.replace(model, **{k: v for k, v in fitted.items()
                                         if not k.startswith("native:")},
                               native_per_byte=tuple(sorted(per_byte.items())))


def main(args, comm) -> int:
    n = comm.size
    if n < 2:
        raise SystemExit("calibrate needs at least 2 ranks (mpiexec -n 2)")
    samples = []
    for name in COLLECTIVES:
        spec = SPECS[name]
        for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
            # the model's N is the per-rank primary buffer: the output block of
            # reduce_scatter, the input of all_gather (bench sizes count the larger buffer)
            count = size // 4 - (size // 4 % n if spec.blocked else 0)
            case = Case(spec, n, comm.rank, count, "float32", "sum" if spec.reduces else None)
            model_bytes = (count // n if spec.kind.parts in ("scatter", "gather") else count) * 4
            for algo in commlib.algorithms(name, comm):
                peer = CommlibPeer(comm, algo)
                t = float(np.median(iteration_times(comm.mpi, lambda: peer.run(case),
                                                    args.iters, 2)))
                samples.append((name, algo, n, model_bytes, t))
    if not args.dry_run:
        comm.measure_algorithms()  # auto's measured table too (commlib/tuning.py)
    if comm.rank != 0:
        return 0
    model = fit(samples, comm.transport, default_model())
    rate = lambda per_byte: 1 / per_byte / 1e9 if per_byte else float("inf")  # noqa: E731
    fitted = [c for c in fitted_constants(samples, comm.transport)[0]
              if not c.startswith("native:")]
    print(f"# calibrate: {n} ranks over {comm.transport}; fitted " + ", ".join(
        f"{c} {model.constant(c) * 1e6:.2f} us" if c.startswith("alpha")
        else f"{c} {rate(model.constant(c)):.2f} GB/s" for c in fitted))
    table = []
    for name, algo, nr, nbytes, t in samples:
        pred = model.predict(name, algo, nr, nbytes, comm.transport)
        table.append([name, algo, nbytes, t * 1e6, pred * 1e6, 100 * (pred - t) / t])
    print_table(["collective", "algorithm", "bytes", "measured(us)", "predicted(us)", "error%"],
                table)
    errors = np.abs([row[-1] for row in table])
    print(f"# model error: median {np.median(errors):.0f}%, 90th percentile "
          f"{np.percentile(errors, 90):.0f}%")
    if not args.dry_run:
        from pathlib import Path
        path = model.save(Path(args.out) if args.out else None)
        print(f"# wrote {path} (commlib loads it at import; COMMLIB_TUNING overrides the path)")
        print("# measured this layout's algorithm table again (auto's choice)")
    return 0
