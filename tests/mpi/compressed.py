"""Compressed collectives (commlib/compressed.py) on every format against a reference that
simulates every rank in numpy (tests/wire_reference.py): results equal bit for bit, on
every rank alike; error feedback's residuals carried across steps as the reference
carries them, and the compressed sum of many steps tracking the exact one.

Usage: mpiexec -n N python tests/mpi/compressed.py   (N = 1..4)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import commlib  # noqa: E402
from commlib import compressed  # noqa: E402
from harness import Checker, raises  # noqa: E402
from wire_reference import round_trip, summed  # noqa: E402

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
FORMATS = ["bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"]
COUNTS = [3, 1001]  # (fewer elements than ranks at 4; a partial last block)


def data(r: int, count: int, step: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * r + 17 * step + count)
    return (rng.standard_normal(count) * np.exp(rng.uniform(-3, 3, count))).astype(np.float32)


def parts(count):  # (start, count) of each rank's part
    base, extra = divmod(count, n)
    return [(i * base + min(i, extra), base + (i < extra)) for i in range(n)]


def expected_all_reduce(xs, fmt, block, factor, workers=None, servers=None, piece=None):
    """Every rank's result, simulated piece by piece: workers/servers (per rank; a server
    residual is its rank's part of each piece, one after the other) updated in place."""
    count = xs[0].size
    piece = piece or max(count, 1)
    out = np.empty_like(xs[0])
    held = [0] * n  # where each rank's server residual for this piece starts
    for base in range(0, count, piece):
        size = min(piece, count - base)
        for j, (start, part) in enumerate(parts(size)):
            lo, hi = base + start, base + start + part
            decoded = []
            for i, x in enumerate(xs):
                y = (x[lo:hi] + (workers[i][lo:hi] if workers else 0)).astype(np.float32)
                d = round_trip(y, fmt, block)
                if workers:
                    workers[i][lo:hi] = y - d
                decoded.append(d)
            total = summed(decoded, factor)
            mine = servers[j][held[j]:held[j] + part] if servers else None
            y = (total + mine).astype(np.float32) if servers else total
            d = round_trip(y, fmt, block)
            if servers:
                mine[:] = y - d
            held[j] += part
            out[lo:hi] = d
    return out


def owned(count, piece, j):
    """The elements rank j sums, in its server residual's order."""
    return np.concatenate([np.arange(base + start, base + start + part)
                           for base in range(0, count, piece)
                           for start, part in [parts(min(piece, count - base))[j]]])


def same_everywhere(got):
    everyone = comm.mpi.allgather(got.tobytes())
    assert all(e == everyone[0] for e in everyone), "the ranks' results differ"


def all_reduce_every_format():
    for fmt in FORMATS:
        for block in (32, 256):
            for count in COUNTS:
                for op, factor, piece in (("sum", 1.0, None), ("avg", 1.0 / n, None),
                                          ("sum", 1.0, 200)):  # (pipelined: 6 pieces)
                    xs = [data(r, count) for r in range(n)]
                    got = xs[rank].copy()
                    compressed.all_reduce(comm, got, compressed.Wire(fmt, block), op=op,
                                          piece=piece or compressed.PIECE)
                    want = xs[rank] if n == 1 else expected_all_reduce(xs, fmt, block, factor,
                                                                       piece=piece)
                    assert np.array_equal(got, want), (fmt, block, count, op, piece,
                                                       np.abs(got - want).max())
                    same_everywhere(got)


def deterministic_mode_gives_the_same_bits():
    """Deterministic mode's promise with compression on: a deterministic communicator's
    compressed all_reduce gives the reference's bits, its reduce_scatter a plain one's
    (only packets move; every sum is in rank order, on one rank)."""
    det = comm.dup(deterministic=True)
    xs = [data(r, 1001) for r in range(n)]
    got = xs[rank].copy()
    compressed.all_reduce(det, got, "int8", op="avg")
    want = xs[rank] if n == 1 else expected_all_reduce(xs, "int8", 64, 1.0 / n)
    assert np.array_equal(got, want), np.abs(got - want).max()
    block = np.empty(1001 // n, np.float32)
    whole = data(rank, 1001)[:n * block.size].copy()
    compressed.reduce_scatter(det, block, whole, "bf16")
    plain = np.empty_like(block)
    compressed.reduce_scatter(comm, plain, whole, "bf16")
    assert np.array_equal(block, plain)


def reduce_scatter_and_all_gather():
    for fmt in FORMATS:
        count = 77
        xs = [data(r, n * count) for r in range(n)]
        out = np.empty(count, np.float32)
        compressed.reduce_scatter(comm, out, xs[rank], fmt, op="avg")
        own = slice(rank * count, (rank + 1) * count)
        want = summed([round_trip(x[own], fmt, 64) for x in xs], 1.0 / n)
        assert np.array_equal(out, want), (fmt, np.abs(out - want).max())
        gathered = np.empty(n * count, np.float32)
        compressed.all_gather(comm, gathered, xs[rank][:count], fmt)
        want = np.concatenate([round_trip(x[:count], fmt, 64) for x in xs])
        assert np.array_equal(gathered, want), fmt


def error_feedback_carries_across_steps():
    """Five steps of int8 and fp8 with feedback match the simulation's residuals; over 40
    steps the compressed sums miss the exact ones by what the residuals hold, closer than
    without feedback."""
    if n == 1:
        return
    count = 501
    for fmt in ("int8", "fp8_e5m2"):
        feedback = compressed.ErrorFeedback()
        workers = [np.zeros(count, np.float32) for _ in range(n)]
        servers = [np.zeros(owned(count, 128, j).size, np.float32) for j in range(n)]
        for step in range(5):
            xs = [data(r, count, step) for r in range(n)]
            got = xs[rank].copy()
            compressed.all_reduce(comm, got, fmt, feedback, piece=128)
            want = expected_all_reduce(xs, fmt, 64, 1.0, workers, servers, piece=128)
            assert np.array_equal(got, want), (fmt, step)
            assert np.array_equal(feedback.worker, workers[rank])
            assert np.array_equal(feedback.server, servers[rank])
        saved = feedback.state_dict()
        again = compressed.ErrorFeedback()
        again.load_state_dict(saved)
        assert np.array_equal(again.worker, feedback.worker)
        # sum over steps of the results = sum of the data - what the residuals still
        # hold (the workers' and the servers'), up to float32's rounding of the sums
        drift = {}
        for label, fb in (("with", compressed.ErrorFeedback()), ("without", None)):
            exact = np.zeros(count, np.float64)
            carried = np.zeros(count, np.float64)
            for step in range(40):
                xs = [data(r, count, 100 + step) for r in range(n)]
                got = xs[rank].copy()
                compressed.all_reduce(comm, got, compressed.Wire(fmt, 256), fb, piece=128)
                carried += got
                exact += np.sum(xs, axis=0, dtype=np.float64)
            drift[label] = np.abs(carried - exact).max() / np.abs(exact).max()
            if fb is not None:
                held = np.sum(comm.mpi.allgather(fb.worker), axis=0, dtype=np.float64)
                for j, server in enumerate(comm.mpi.allgather(fb.server)):
                    held[owned(count, 128, j)] += server
                assert np.abs(carried + held - exact).max() < 1e-4 * np.abs(exact).max(), fmt
        assert drift["with"] < drift["without"], (fmt, drift)


def bad_input_says_what_and_how():
    x = np.ones(10, np.float32)
    raises(ValueError, "unknown wire format", lambda: compressed.Wire("int4"))
    raises(ValueError, "block of 32, 64, 128, 256", lambda: compressed.Wire("int8", 48))
    raises(TypeError, "takes float32 data, not int32",
           lambda: compressed.all_reduce(comm, np.ones(10, np.int32), "int8"))
    raises(ValueError, "piece=0; give a positive number of elements",
           lambda: compressed.all_reduce(comm, x, "int8", piece=0))
    raises(ValueError, "op 'max' cannot be compressed",
           lambda: compressed.all_reduce(comm, x, "int8", op="max"))
    raises(ValueError, f"input has 10 elements, needs {n} x the output's 11",
           lambda: compressed.reduce_scatter(comm, np.ones(11, np.float32), x, "int8"))
    raises(ValueError, f"output has 10 elements, needs {n} x the input's 11",
           lambda: compressed.all_gather(comm, x, np.ones(11, np.float32), "bf16"))
    if n > 1:
        feedback = compressed.ErrorFeedback()
        compressed.all_reduce(comm, x.copy(), "int8", feedback)
        raises(ValueError, "one ErrorFeedback per tensor",
               lambda: compressed.all_reduce(comm, np.ones(12, np.float32), "int8", feedback))


check.run_cases(globals())
