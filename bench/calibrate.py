"""calibrate: fit the cost model's alpha, beta, gamma to this machine; write the tuning file.

Each algorithm's cost is linear in the constants (commlib.select: rounds*alpha +
moved*beta + reduced*gamma; native: rounds*alpha_native + moved*per_byte[collective]), so
measured times give a least-squares problem, weighted by 1/time so that small messages
count as much as large ones, with non-negative solutions. Prints predicted vs measured for
every measurement so the model's error is visible.
"""
from __future__ import annotations

import numpy as np

import commlib
import dataclasses

from commlib.select import (DEFAULT_MODEL, DIRECT_FORMULAS, FORMULAS, NATIVE_FORMULAS, CostModel,
                            shm_terms, tuning_path)

from .harness import iteration_times, parse_size, print_table, sizes
from .peers import Case, CommlibPeer
from .specs import SPECS

COLLECTIVES = list(NATIVE_FORMULAS)


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


def _coefficients(collective, algorithm, n, nbytes, transport):
    """The row of the least-squares problem: coefficients of the fitted constants."""
    if algorithm == "direct":
        rounds, moved, reduced = DIRECT_FORMULAS[collective](n, nbytes)
        return rounds, 0, moved, reduced
    if transport == "shm":
        rounds, copied, reduced = shm_terms(collective, algorithm, n, nbytes)
        return max(rounds, 1), copied, 0, reduced
    return FORMULAS[(collective, algorithm)](n, nbytes)


def fit(samples, transport: str = "mpi", base: CostModel | None = None) -> CostModel:
    """samples: (collective, algorithm, n, nbytes, seconds) -> ``base`` (default: the
    built-in constants) with the constants of ``transport`` ("shm": alpha_shm, beta_shm,
    beta_direct, gamma_shm; otherwise alpha, beta, gamma) and native's fitted. Constants
    without data keep their values."""
    default = base or CostModel()
    names = (("alpha_shm", "beta_shm", "beta_direct", "gamma_shm") if transport == "shm"
             else ("alpha", "beta", "gamma"))
    sched = [(_coefficients(c, a, n, b, transport), t) for c, a, n, b, t in samples
             if a not in ("native", "hier")]
    params = {name: getattr(default, name) for name in names}
    if sched:
        X = np.array([coef for coef, _ in sched], float)
        y = np.array([t for _, t in sched])
        w = 1 / y
        params.update(zip(names, nnls(X * w[:, None], y * w)))
    native = [(c, NATIVE_FORMULAS[c](n, b), t) for c, a, n, b, t in samples if a == "native"]
    per_byte = dict(default.native_per_byte)
    alpha_native = default.alpha_native
    if native:
        cols = sorted({c for c, _, _ in native})
        X = np.zeros((len(native), 1 + len(cols)))
        for i, (c, (rounds, moved), _) in enumerate(native):
            X[i, 0], X[i, 1 + cols.index(c)] = max(1, rounds), moved
        y = np.array([t for _, _, t in native])
        w = 1 / y
        x = nnls(X * w[:, None], y * w)
        alpha_native = x[0]
        per_byte.update(zip(cols, x[1:]))
    return dataclasses.replace(default, **params, alpha_native=alpha_native,
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
            model_bytes = (count // n if name in ("reduce_scatter", "all_gather") else count) * 4
            for algo in commlib.algorithms(name, comm):
                peer = CommlibPeer(comm, algo)
                t = float(np.median(iteration_times(comm.mpi, lambda: peer.run(case),
                                                    args.iters, 2)))
                samples.append((name, algo, n, model_bytes, t))
    if comm.rank != 0:
        return 0
    model = fit(samples, comm.transport, DEFAULT_MODEL)
    rate = lambda per_byte: 1 / per_byte / 1e9 if per_byte else float("inf")  # noqa: E731
    shm = comm.transport == "shm"
    fitted = (("alpha_shm", "beta_shm", "beta_direct", "gamma_shm") if shm
              else ("alpha", "beta", "gamma"))
    print(f"# calibrate: {n} ranks over {comm.transport}; fitted " + ", ".join(
        f"{c} {getattr(model, c) * 1e6:.2f} us" if c.startswith("alpha")
        else f"{c} {rate(getattr(model, c)):.2f} GB/s" for c in fitted + ("alpha_native",)))
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
    return 0
