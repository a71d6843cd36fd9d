"""Algorithm choice: explicit names, the environment override, and the cost model."""
import math

import pytest

from commlib import algorithms
from commlib.select import CostModel, choose

DEFAULTS = CostModel()  # not the machine's tuning file: these tests must not depend on it


def test_explicit_and_environment(monkeypatch):
    assert choose("all_reduce", "tree", 4, 1 << 20).name == "tree"
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "ring")
    assert choose("all_reduce", None, 4, 8).name == "ring"
    assert choose("all_reduce", "rhd", 4, 8).name == "rhd"  # the argument beats the environment
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "fastest")
    with pytest.raises(ValueError, match="unknown algorithm 'fastest' for all_reduce; valid: "
                                         "native, rhd, ring, tree"):  # on a plain MPI comm
        choose("all_reduce", None, 4, 8)


def test_model_prefers_latency_small_and_bandwidth_large():
    # MPI's own collective wins tiny messages (less per-round overhead); the schedules win
    # large all_reduce, where they measured faster than MPICH (see
    # commlib_bench/all_reduce_sweep.py)
    assert choose("all_reduce", None, 2, 8, DEFAULTS).name == "native"
    assert choose("all_reduce", None, 2, 64 << 20, DEFAULTS).name in ("ring", "rhd")
    assert choose("all_reduce", None, 3, 64 << 20, DEFAULTS).name == "ring"  # rhd folds
    assert choose("reduce", None, 4, 8 << 20, DEFAULTS).name == "tree"


def test_every_algorithm_has_a_cost():
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                       "reduce"):
        for name in algorithms(collective):
            for n in (1, 2, 5, 16):
                if name == "hier" and n == 1:  # needs two hosts at least
                    continue
                nbytes = 256 if name == "eager" else 1 << 16  # (eager: small calls only)
                cost = DEFAULTS.predict(collective, name, n, nbytes,
                                        "shm" if name in ("direct", "one_copy") else "mpi", 1)
                assert 0 < cost < math.inf, (collective, name, n)
    assert DEFAULTS.predict("all_reduce", "eager", 2, 1 << 17) == math.inf  # beyond its limit


def test_tuning_file_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("COMMLIB_TUNING", str(path))
    assert CostModel.load() == CostModel()  # no file: defaults
    tuned = CostModel(alpha=1e-5, beta=2e-10, gamma=3e-11, alpha_native=5e-6,
                      native_per_byte=tuple(sorted({**dict(DEFAULTS.native_per_byte),
                                                    "all_reduce": 1e-10}.items())))
    assert tuned.save() == path
    assert CostModel.load() == tuned
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibrate"):
        CostModel.load()
