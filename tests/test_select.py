"""Algorithm choice: explicit names, the environment override, and the cost model."""
import math

import pytest

from commlib import algorithms
from commlib.select import DEFAULT_MODEL, choose


def test_explicit_and_environment(monkeypatch):
    assert choose("all_reduce", "tree", 4, 1 << 20).name == "tree"
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "ring")
    assert choose("all_reduce", None, 4, 8).name == "ring"
    assert choose("all_reduce", "rhd", 4, 8).name == "rhd"  # the argument beats the environment
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "fastest")
    with pytest.raises(ValueError, match="unknown algorithm 'fastest' for all_reduce; valid: "
                                         "native, rhd, ring, tree"):
        choose("all_reduce", None, 4, 8)


def test_model_prefers_latency_small_and_bandwidth_large():
    # MPI's own collective wins tiny messages (less per-round overhead); the schedules win
    # large all_reduce, where they measured faster than MPICH (see bench/all_reduce_sweep.py)
    assert choose("all_reduce", None, 2, 8).name == "native"
    assert choose("all_reduce", None, 2, 64 << 20).name in ("ring", "rhd")
    assert choose("all_reduce", None, 3, 64 << 20).name == "ring"  # rhd folds at odd sizes
    assert choose("reduce", None, 4, 8 << 20).name == "tree"


def test_every_algorithm_has_a_cost():
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                       "reduce"):
        for name in algorithms(collective):
            for n in (1, 2, 5, 16):
                cost = DEFAULT_MODEL.predict(collective, name, n, 1 << 16)
                assert 0 < cost < math.inf, (collective, name, n)
