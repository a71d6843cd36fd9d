"""user-ops: a user-defined reduce op against the built-in one and against mpi4py's.

One Python function, ``add(a, b) = a + b``, all-reduced on float32 four ways, interleaved:
  commlib:sum       the built-in sum (auto)
  commlib:user      commlib.ReduceOp.define(add): compiled by numba, called by C++ on blocks
  mpi:Op.Create     MPI.Op.Create over the same function, element by element under the GIL
                    (what mpi4py offers a scalar function); only up to --python-max bytes
  mpi:Op.Create+np  MPI.Op.Create over numpy's vectorised add: the best an mpi4py op gets
Times are medians over iterations (each the slowest rank's); user/sum is the ratio of
commlib:sum's time to commlib:user's (1.0: as fast as the built-in).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import commlib

from .harness import iteration_times, parse_size, print_table, sizes, write_json


def add(a, b):
    return a + b


def _mpi_ops() -> dict:
    def elementwise(inbuf, inoutbuf, datatype):
        src, dst = np.frombuffer(inbuf, np.float32), np.frombuffer(inoutbuf, np.float32)
        for i in range(len(dst)):
            dst[i] = add(src[i], dst[i])

    def vectorised(inbuf, inoutbuf, datatype):
        dst = np.frombuffer(inoutbuf, np.float32)
        np.add(np.frombuffer(inbuf, np.float32), dst, out=dst)
    return {"mpi:Op.Create": MPI.Op.Create(elementwise, commute=True),
            "mpi:Op.Create+np": MPI.Op.Create(vectorised, commute=True)}


def add_arguments(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=1 << 10)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--python-max", type=parse_size, default=1 << 20,
                   help="largest size for the element-by-element mpi4py op (slow)")
    p.add_argument("--json")


def main(args, comm) -> int:
    world = comm.mpi
    user = commlib.ReduceOp.define(add, "float32")
    mpi_ops = _mpi_ops()
    impls = {"commlib:sum": lambda buf: comm.all_reduce(buf),
             "commlib:user": lambda buf: comm.all_reduce(buf, op=user),
             **{name: lambda buf, op=op: world.Allreduce(MPI.IN_PLACE, buf, op=op)
                for name, op in mpi_ops.items()}}
    rows = []
    for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        buf = np.ones(max(1, size // 4), np.float32)
        check = (np.arange(buf.size) % 1000 + comm.rank).astype(np.float32)
        want = check.copy()
        comm.all_reduce(want)
        comm.all_reduce(check, op=user)
        if not np.array_equal(check, want):
            raise SystemExit(f"user-ops: the user-defined sum differs from the built-in at "
                             f"{buf.nbytes} bytes")
        row = {"size": buf.nbytes}
        for name, run in impls.items():
            if name == "mpi:Op.Create" and size > args.python_max:
                row[name] = float("nan")
                continue
            iters = args.iters if name != "mpi:Op.Create" else max(3, args.iters // 4)
            row[name] = float(np.median(iteration_times(world, lambda: run(buf), iters, 2)))
        row["user/sum"] = row["commlib:sum"] / row["commlib:user"]
        rows.append(row)
    if comm.rank == 0:
        print(f"# user-ops: all_reduce float32, {comm.size} ranks over {comm.transport}; "
              f"median us of {args.iters} iterations")
        print_table(["size", *impls, "user/sum"],
                    [[r["size"], *(r[i] * 1e6 for i in impls), r["user/sum"]] for r in rows])
        if args.json:
            write_json(args.json, "user-ops", world, rows)
    for op in mpi_ops.values():
        op.Free()
    return 0
