"""Every algorithm x collective x dtype x op x count (x in-place), checked exactly.

Usage: mpiexec -n N python tests/mpi/matrix.py numpy|torch [large|large-float32] [narrow]
       [only=ALGO,...]
(the layout of hosts, or COMMLIB_TRANSPORT and COMMLIB_RANKS_PER_HOST, selects the path;
see commlib/transports/)
"""
import sys
from functools import lru_cache

import numpy as np

import commlib
from commlib import settings
from commlib.algorithms import entries
from commlib.transports.rows import mpi_payload_bytes
from harness import (ALL_DTYPES, NUMPY_DTYPES, Checker, assert_equal, expected_transport, make,
                     raises, to_f64, values)

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "numpy"
comm = commlib.init()
n, rank = comm.size, comm.rank
DTYPES = ALL_DTYPES if BACKEND == "torch" else NUMPY_DTYPES
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "absmax"]
BITWISE = ("band", "bor", "bxor")  # integer dtypes only, as avg is floating only


def absmax(a, b):
    return max(abs(a), abs(b))


# (count, dtypes, ops): small counts (empty, one, fewer than the ranks, odd); with "large",
# past the slot, segment and staging sizes in every dtype, and past csrc/shm.h's
# kStreamingBytes (8 MB) in one dtype and op
SIZES = [(count, DTYPES, OPS) for count in sorted({0, 1, max(n - 1, 0), 13})]
if "large" in sys.argv:
    # torch's large counts only where numpy has no such dtype (numpy runs the others)
    # (the ops' kernels at the small counts; at the large ones, one of each kind: a sum, a
    # comparison, the scaled, a bitwise and the user-defined op, across every piece)
    SIZES += [((1 << 18) + 7, DTYPES, ["sum", "max", "avg", "bxor", "absmax"])
              if BACKEND == "numpy" else ((1 << 18) + 7, ["bfloat16"], OPS),
              ((1 << 21) + 3, ["float32"], ["sum"])]
elif "large-float32" in sys.argv:  # (where every byte crosses TCP: the large counts once)
    SIZES += [((1 << 18) + 7, ["float32"], ["sum", "max"]), ((1 << 21) + 3, ["float32"], ["sum"])]
# "narrow": ordered (made of other collectives) and the user-defined absmax (commlib's
# kernels through another op) run float32 alone: the one-host runs give them every dtype.
# Where every byte crosses TCP (large-float32), ordered runs the small counts only, too.
NARROW = "narrow" in sys.argv or "large-float32" in sys.argv
# a user-defined op (numba-compiled) for every dtype but int8, which it must refuse; narrow
# runs it in float32 alone, so compiles it for that alone (a second or more a rank, else)
USER_OPS = {"absmax": commlib.ReduceOp.define(
    absmax, ["float32"] if NARROW else [d for d in ALL_DTYPES if d != "int8"])}
SMALL_ONLY = {"ordered"} if "large-float32" in sys.argv else set()
# "only=a,b": just those algorithms (where only they use what a test varies)
ONLY = next((arg.removeprefix("only=").split(",") for arg in sys.argv if arg.startswith("only=")),
            None)
def _bitwise(f):  # on the float64 of integer values: in int64 (two's complement, as any width)
    return lambda a, b: f(a.astype(np.int64), b.astype(np.int64)).astype(np.float64)


REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "avg": np.add, "band": _bitwise(np.bitwise_and), "bor": _bitwise(np.bitwise_or),
          "bxor": _bitwise(np.bitwise_xor),
          "absmax": lambda a, b: np.maximum(np.abs(a), np.abs(b))}
check = Checker()


@lru_cache(maxsize=8)
def reduced(count, op, dtype):
    """Reduction of every rank's values(count, r, op, dtype), computed locally."""
    total = values(count, 0, op, dtype)
    for r in range(1, n):
        total = REDUCE[op](total, values(count, r, op, dtype))
    return total / n if op == "avg" else total


def expect_equal(got, want, dtype, op):
    got = to_f64(got)
    if op == "avg":  # sum / n is not exact for n = 3; compare against float64 within dtype eps
        tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        assert_equal(got, want)


def run(collective, algo, dtype, op, count, inplace):
    name = f"{collective}/{algo}/{dtype}/{op}/count={count}/{'inplace' if inplace else 'out'}"
    a = None if algo == "auto" else algo
    reduce_op = USER_OPS.get(op, op)
    floating = dtype.startswith(("float", "bfloat"))
    if op in USER_OPS and dtype in USER_OPS[op].dtypes and a is not None and \
            not entries(collective)[a].user_ops:
        assert a not in comm.algorithms(collective, count=count, dtype=dtype,
                                        op=USER_OPS[op]), name
        if collective == "all_reduce":
            check.check(name, lambda: raises(ValueError, "user-defined", lambda: (
                comm.all_reduce(make(values(count, rank, "sum", dtype), dtype, BACKEND),
                                op=USER_OPS[op], algorithm=a))))
        return
    if op == "avg" and not floating or op in BITWISE and floating or \
            op in USER_OPS and dtype not in USER_OPS[op].dtypes:
        def refused():
            t = make(values(count, rank, "sum", dtype), dtype, BACKEND)
            try:
                getattr(comm, collective)(*([t, t] if collective == "reduce_scatter" else [t]),
                                          op=reduce_op, algorithm=a)
            except ValueError as e:
                assert f"'{op}'" in str(e), e
            else:
                raise AssertionError(f"{op} on {dtype} was accepted")
        if collective in ("all_reduce", "reduce"):
            check.check(name, refused)
        return
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if algo == "eager" and count * itemsize * (n if collective == "reduce_scatter" else 1) \
            > mpi_payload_bytes(n):
        assert a not in comm.algorithms(collective, count=count, dtype=dtype), name
        if collective == "all_reduce" and op == "sum":  # refused, alike on every rank
            check.check(name, lambda: raises(ValueError, "eager sends at most", lambda: (
                comm.all_reduce(make(values(count, rank, "sum", dtype), dtype, BACKEND),
                                algorithm="eager"))))
        return

    def case():
        mine = values(count, rank, op or "sum", dtype)
        if collective == "all_reduce":
            t = make(mine, dtype, BACKEND)
            assert a is None or a in comm.algorithms("all_reduce", t, op=reduce_op), name
            comm.all_reduce(t, op=reduce_op, algorithm=a)
            expect_equal(t, reduced(count, op, dtype), dtype, op)
        elif collective == "reduce":
            root = count % n
            t = make(mine, dtype, BACKEND)
            comm.reduce(t, root=root, op=reduce_op, algorithm=a)
            expect_equal(t, reduced(count, op, dtype) if rank == root else mine, dtype,
                         op if rank == root else None)
        elif collective == "broadcast":
            root = (count + 1) % n
            t = make(values(count, rank, "sum", dtype) if rank == root
                     else np.zeros(count), dtype, BACKEND)
            comm.broadcast(t, root=root, algorithm=a)
            expect_equal(t, values(count, root, "sum", dtype), dtype, None)
        elif collective == "reduce_scatter":
            full = make(values(n * count, rank, op, dtype), dtype, BACKEND)
            before = to_f64(full).copy()
            out = full[rank * count:(rank + 1) * count] if inplace else make(
                np.zeros(count), dtype, BACKEND)
            comm.reduce_scatter(out, full, op=reduce_op, algorithm=a)
            want = reduced(n * count, op, dtype)[rank * count:(rank + 1) * count]
            expect_equal(out, want, dtype, op)
            if not inplace:
                assert_equal(to_f64(full), before)  # the input is left untouched
        elif collective == "all_gather":
            want = np.concatenate([values(count, r, "sum", dtype) for r in range(n)])
            out = make(np.zeros(n * count), dtype, BACKEND)
            inp = out[rank * count:(rank + 1) * count] if inplace else make(mine, dtype, BACKEND)
            if inplace:
                inp[:] = make(mine, dtype, BACKEND)
            comm.all_gather(out, inp, algorithm=a)
            expect_equal(out, want, dtype, None)
        elif collective == "all_to_all":
            # uneven: rank r sends (r + j + count) % 4 * (count % 7 + 1) elements to rank j
            split = lambda src, dst: ((src + dst + count) % 4) * (count % 7 + 1)  # noqa
            isplits = [split(rank, j) for j in range(n)]
            osplits = [split(j, rank) for j in range(n)]
            data = values(sum(isplits), rank, "sum", dtype, salt=rank)
            out = make(np.zeros(sum(osplits)), dtype, BACKEND)
            comm.all_to_all(out, make(data, dtype, BACKEND), osplits, isplits, algorithm=a)
            want = []
            for src in range(n):
                theirs = values(sum(split(src, j) for j in range(n)), src, "sum", dtype, salt=src)
                start = sum(split(src, j) for j in range(rank))
                want.append(theirs[start:start + split(src, rank)])
            expect_equal(out, np.concatenate(want), dtype, None)
            even = make(np.arange(n * 3, dtype=np.float64) + 10 * rank, dtype, BACKEND)
            got = make(np.zeros(n * 3), dtype, BACKEND)
            comm.all_to_all(got, even, algorithm=a)
            expect_equal(got, np.concatenate([np.arange(rank * 3, rank * 3 + 3) + 10 * r
                                              for r in range(n)]), dtype, None)
    check.check(name, case)


def on_expected_transport():
    assert comm.transport == expected_transport(), (comm.transport, expected_transport())
    special = {"shm": "direct", "hosts": "hier"}.get(comm.transport)
    if special:
        assert special in comm.algorithms("all_reduce")
    if comm.transport == "shm" and settings.get("COMMLIB_ONE_COPY"):
        # (set-up warned why, where process_vm_readv is forbidden)
        assert "one_copy" in comm.algorithms("all_to_all"), "one-copy collectives are off"


check.check(f"transport {expected_transport()}", on_expected_transport)


def eager_over_gloo():
    """Between torchrun's nodes, eager's data ride in rows of a fixed length, shorter than
    MPI's (transports/gloo.py): a call they cannot carry is refused, on every rank alike;
    ranks of which some run a call eagerly and some not are told they disagree (gloo
    would abort the processes on all-gathers of different lengths), and go on."""
    big = np.ones(4096, np.float32)  # 16 KiB
    raises(ValueError, "eager sends at most", lambda: comm.all_reduce(big, algorithm="eager"))
    mismatch = commlib.CollectiveMismatchError
    raises(mismatch, "", lambda: comm.all_reduce(big[:8], algorithm="eager" if rank else "gloo"))
    raises(mismatch, "", lambda: comm.all_reduce(big if rank == 0 else big[:8]))  # auto
    comm.all_reduce(big[:8], algorithm="eager")
    assert big[:8].tolist() == [n] * 8


if "gloo" in comm.algorithms("all_reduce"):
    check.check("eager over gloo", eager_over_gloo)
# count and data outermost, so the cached inputs and references are reused by every algorithm
for count, dtypes, ops in SIZES:
    for dtype in dtypes:
        for op in ops + [None]:
            for collective in ("all_reduce", "reduce_scatter", "reduce", "all_gather",
                               "all_to_all", "broadcast"):
                if (op is None) == (collective in ("all_reduce", "reduce_scatter", "reduce")):
                    continue
                narrowed = NARROW and dtype != "float32"
                for algo in [a for a in comm.algorithms(collective) + ["auto"]
                             if (ONLY is None or a in ONLY)
                             and not (a in SMALL_ONLY and count > 13)
                             and not (narrowed and (a == "ordered" or op in USER_OPS))]:
                    for inplace in ([False, True] if collective in ("reduce_scatter",
                                                                    "all_gather") else [False]):
                        run(collective, algo, dtype, op, count, inplace)
check.finish()
