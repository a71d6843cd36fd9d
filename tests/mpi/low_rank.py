"""Low-rank averaging (commlib/low_rank.py, PowerSGD) against numpy: a gradient that is
rank r on every rank comes back exact; vectors and small matrices are averaged as they
are; with error feedback the sum of many steps' averages tracks the exact sum; every
rank gets the same bits; bad input is refused by name.

Usage: mpiexec -n N python tests/mpi/low_rank.py   (N = 1..4)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import commlib  # noqa: E402
from commlib.low_rank import LowRankState, PowerSGD  # noqa: E402
from harness import Checker, raises  # noqa: E402

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()


def same_everywhere(got):
    mine = np.ascontiguousarray(got, np.float32).reshape(-1)
    every = np.empty(n * mine.size, np.float32)
    comm.all_gather(every, mine)
    assert all(np.array_equal(every.reshape(n, -1)[r], mine) for r in range(n))


def rank_r_gradients_come_back_exact():
    rng = np.random.default_rng(7)  # the same subspaces on every rank, other weights
    u, v = rng.standard_normal((48, 3)), rng.standard_normal((35, 3))
    weights = [np.random.default_rng(100 + r).standard_normal(3) for r in range(n)]
    mine = (u * weights[rank]) @ v.T
    want = sum((u * w) @ v.T for w in weights) / n
    bias = np.arange(5, dtype=np.float32) * (rank + 1)
    tensors = [mine.astype(np.float32).reshape(48, 5, 7), bias]
    PowerSGD(rank=3, feedback=False).all_reduce(comm, tensors, LowRankState())
    got = tensors[0].reshape(48, 35)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    assert np.array_equal(bias, np.arange(5, dtype=np.float32) * (n + 1) / 2)
    same_everywhere(got)


def error_feedback_tracks_the_exact_sum():
    shapes = [(64, 40), (40,), (6, 5)]  # (6 x 5 at rank 2 saves too little: sent whole)
    steps, gaps = 30, {}
    u = np.random.default_rng(1).standard_normal((shapes[0][0], 4))
    v = np.random.default_rng(2).standard_normal((shapes[0][1], 4))
    for feedback in (True, False):
        powersgd, state = PowerSGD(rank=2, feedback=feedback), LowRankState()
        exact = [np.zeros(s, np.float64) for s in shapes]
        sent = [np.zeros(s, np.float64) for s in shapes]
        for step in range(steps):
            # the same gradient every step, of rank 4 (as gradients are nearly low-rank):
            # without feedback, what rank 2 leaves out of it is lost every step; with
            # it, sent in the next ones
            tensors = [np.random.default_rng((rank, k)).standard_normal(s)
                       .astype(np.float32) for k, s in enumerate(shapes)]
            tensors[0] = (u * np.random.default_rng(rank).uniform(1, 2, 4) @ v.T).astype(
                np.float32)
            for k, t in enumerate(tensors):
                total = t.astype(np.float64)
                comm.all_reduce(total)
                exact[k] += total / n
            powersgd.all_reduce(comm, tensors, state)
            for k, t in enumerate(tensors):
                sent[k] += t
            same_everywhere(tensors[0])
        gaps[feedback] = np.abs(sent[0] - exact[0]).max()
        for k in (1, 2):  # sent whole: exact but for float32's rounding
            assert np.abs(sent[k] - exact[k]).max() < 1e-4 * steps, k
        if feedback:  # what was sent = the exact sum less the ranks' mean residual
            residual = state.residuals.get(0, np.zeros(shapes[0], np.float32))
            residual = residual.astype(np.float64)
            comm.all_reduce(residual)
            gap = np.abs(sent[0] + residual / n - exact[0]).max()
            assert gap < 1e-3 * np.abs(exact[0]).max(), gap
    if n > 1:
        assert gaps[True] < 0.2 * gaps[False], gaps
    else:
        assert gaps[True] == gaps[False] == 0, gaps


def bad_input_says_what_and_how():
    raises(ValueError, "the factors' rank is a positive int", lambda: PowerSGD(rank=0))
    raises(TypeError, "tensor 1 must be float32",
           lambda: PowerSGD().all_reduce(comm, [np.ones(4, np.float32), np.ones(4)],
                                         LowRankState()))
    raises(ValueError, "sums or averages, not 'max'",
           lambda: PowerSGD().all_reduce(comm, [np.ones(4, np.float32)], LowRankState(),
                                         op="max"))
    if n > 1:
        state = LowRankState()
        PowerSGD(rank=1).all_reduce(comm, [np.ones((20, 10), np.float32)], state)
        raises(ValueError, "one LowRankState per tensor list",
               lambda: PowerSGD(rank=1).all_reduce(comm, [np.ones((30, 10), np.float32)],
                                                   state))


check.run_cases(globals())
