"""The benchmark CLI end to end under mpiexec at small sizes, and its formulas."""
import json
import re

import numpy as np
import pytest

from commlib_bench.calibrate import fit
from commlib_bench.harness import parse_size, sizes
from commlib_bench.overlap import overlap_percent
from commlib_bench.specs import SPECS, count_wrong
from commlib.algorithms import COLLECTIVES, entries
from commlib.select import CostModel
from mpirun import mpirun


def bench(n, *args, timeout=240):
    code, out = mpirun(n, "-m", "commlib_bench", *args, timeout=timeout)
    assert code == 0, (f"python -m commlib_bench {' '.join(args)} on {n} ranks exited {code}:\n"
                       f"{out[-4000:]}")
    return out


def rows(out):
    """Data rows of a '#'-headed table."""
    return [line.split() for line in out.splitlines()
            if line.strip() and not line.startswith(("#", "["))]


def test_busbw_factors_follow_nccl_tests():
    for n in (1, 2, 3, 8):
        assert SPECS["all_reduce"].busbw_factor(n) == 2 * (n - 1) / n
        for name in ("reduce_scatter", "all_gather", "all_to_all"):
            assert SPECS[name].busbw_factor(n) == (n - 1) / n
        assert SPECS["broadcast"].busbw_factor(n) == SPECS["reduce"].busbw_factor(n) == 1


def test_bounds_follow_the_bytes_each_rank_moves():
    """At memcpy's 10 GB/s: a copy of the whole size per rank bounds all_to_all and
    all_gather at 10 (n-1)/n, a broadcast at 10; reductions read more than they write."""
    for n in (2, 3, 8):
        for name in ("all_gather", "all_to_all"):
            assert SPECS[name].bound(n, 10) == pytest.approx(10 * (n - 1) / n)
        assert SPECS["broadcast"].bound(n, 10) == pytest.approx(10)
        # reduce_scatter: read the block from n inputs, write it: (1 + 1/n) per byte
        assert SPECS["reduce_scatter"].bound(n, 10) == pytest.approx(20 * (n - 1) / (n + 1))
        # all_reduce: that, then copy the n - 1 missing blocks in: (3 - 1/n) per byte
        assert SPECS["all_reduce"].bound(n, 10) == pytest.approx(40 * (n - 1) / (3 * n - 1))
    assert SPECS["all_reduce"].bound(2, 10) == pytest.approx(8)


def test_overlap_formula():
    assert overlap_percent(overall=100, compute_time=100, pure_comm=50) == 100  # all hidden
    assert overlap_percent(overall=150, compute_time=100, pure_comm=50) == 0    # none hidden
    assert overlap_percent(overall=120, compute_time=100, pure_comm=50) == pytest.approx(60)
    assert overlap_percent(overall=300, compute_time=100, pure_comm=50) == 0    # clamped


def test_sizes_and_wrong_counts():
    assert parse_size("64K") == 65536 and parse_size("2M") == 2 << 20 and parse_size("8") == 8
    assert sizes(8, 64, 2) == [8, 16, 32, 64] and sizes(0, 4, 4) == [0, 1, 4]
    with pytest.raises(ValueError):
        parse_size("lots")
    want = np.arange(10.0)
    got = want.copy()
    got[3] = -1
    assert count_wrong(want, want, "float32", "sum") == 0
    assert count_wrong(got, want, "float32", "sum") == 1
    assert count_wrong(want * (1 + 1e-9), want, "float32", "avg") == 0


SCHEDULES = [(c, a.name) for c in COLLECTIVES for a in entries(c).values() if a.build]


def test_calibrate_recovers_known_constants():
    truth = CostModel(alpha=12e-6, beta=1 / 5e9, gamma=1 / 30e9, alpha_native=3e-6,
                      native_per_byte=tuple(sorted((c, 1e-10 * (i + 1))
                                                   for i, c in enumerate(COLLECTIVES))))
    rng = np.random.default_rng(0)
    samples = [(c, a, n, b, truth.predict(c, a, n, b) * (1 + rng.normal(0, 0.002)))
               for (c, a) in SCHEDULES + [(c, "native") for c in COLLECTIVES]
               for n in (2, 3, 4) for b in (64, 4096, 1 << 18, 1 << 22)]
    got = fit(samples)
    for field in ("alpha", "beta", "gamma", "alpha_native"):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=0.02), field
    for (c, v), (c2, v2) in zip(got.native_per_byte, truth.native_per_byte):
        assert c == c2 and v == pytest.approx(v2, rel=0.02)


def test_calibrate_recovers_shared_memory_constants():
    truth = CostModel(alpha_shm=1.2e-6, beta_shm=1 / 20e9, beta_direct=1 / 35e9,
                      gamma_shm=1 / 60e9)
    rng = np.random.default_rng(1)
    pairs = SCHEDULES + [(c, "direct") for c in COLLECTIVES]
    samples = [(c, a, n, b, truth.predict(c, a, n, b, "shm") * (1 + rng.normal(0, 0.002)))
               for (c, a) in pairs for n in (2, 3, 4) for b in (64, 4096, 1 << 18, 1 << 22)]
    got = fit(samples, "shm")
    for field in ("alpha_shm", "beta_shm", "beta_direct", "gamma_shm"):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=0.02), field
    assert got.alpha == CostModel().alpha  # the MPI constants are left alone


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("collective", list(SPECS))
def test_collective_sweep(n, collective, tmp_path):
    extra = ["--inplace"] if collective in ("reduce_scatter", "all_gather") and n == 3 else []
    path = tmp_path / "out.json"
    out = bench(n, collective, "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1",
                "--algo", "all", "-r", str(n - 1), "--json", str(path), *extra)
    table = rows(out)
    assert table and all(r[-1] in ("0", "n/a") for r in table), out
    assert {r[5] for r in table} >= {"commlib:auto", "commlib:native"}
    doc = json.loads(path.read_text())
    assert doc["ranks"] == n and doc["command"] == collective
    for r in doc["results"]:
        assert {"size", "count", "type", "redop", "root", "impl", "time", "algbw", "busbw",
                "wrong"} <= set(r)
        assert r["wrong"] in (0, None)


def test_compare_writes_table_json_and_plot(tmp_path):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    out = bench(2, "compare", "all_reduce", "all_to_all", "-b", "64", "-e", "256K", "-f", "64",
                "--reps", "2", "--json", str(js), "--plot", str(png), "--pages", "huge",
                "--fresh")
    assert "best/peer" in out and "commlib:auto" in out
    assert "each input written before every call" in out
    doc = json.loads(js.read_text())
    assert doc["fresh"] is True
    impls = {r["impl"] for r in doc["results"]}
    assert {"commlib:ring", "commlib:auto", "mpi", "memcpy", "bound"} <= impls
    assert "best/bound" in out and "peer/bound" in out
    assert all(r.get("wrong", 0) == 0 for r in doc["results"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_compare_on_memory_the_ranks_map(tmp_path):
    """--pages region: every peer (MPI's too) on Communicator.empty's memory, at an odd
    size of world, each output checked."""
    js = tmp_path / "r.json"
    out = bench(3, "compare", "all_gather", "broadcast", "all_reduce", "-b", "4K", "-e", "64K",
                "-f", "16", "--reps", "1", "--no-gloo", "--pages", "region", "--json", str(js),
                "--plot", "")
    results = json.loads(js.read_text())["results"]
    assert {"commlib:one_copy", "commlib:auto", "mpi"} <= {r["impl"] for r in results}, out
    assert len({r["collective"] for r in results}) == 3
    assert all(r.get("wrong", 0) == 0 for r in results), out


@pytest.mark.parametrize("command", ["latency", "bandwidth", "bibw"])
def test_point_to_point(command):
    out = bench(2, command, "-b", "0", "-e", "4K", "-f", "64", "-n", "5", "-w", "1")
    values = [float(r[1]) for r in rows(out)]
    assert len(values) == 4  # sizes 0, 1, 64, 4096
    assert all(v > 0 for v in (values if command == "latency" else values[1:]))


def test_overlap_and_calibrate(tmp_path):
    out = bench(2, "overlap", "-b", "64K", "-e", "64K", "-n", "3")
    assert re.search(r"commlib:auto\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+", out), out
    tuning = tmp_path / "tuning.json"
    out = bench(2, "calibrate", "-b", "64", "-e", "64K", "-f", "32", "-n", "3", "--out",
                str(tuning))
    assert "model error" in out and tuning.exists()
    assert CostModel.load(tuning).alpha > 0
    out = bench(2, "user-ops", "-b", "1K", "-e", "64K", "-f", "64", "-n", "3")
    assert [len(r) for r in rows(out)] == [6, 6], out  # size, 4 times, user/sum


def test_torch_latency(tmp_path):
    """The PyTorch path's table at 3 ranks: every peer that runs here checked and timed
    (DeepSpeed's where it is installed: n/a otherwise)."""
    pytest.importorskip("torch")
    js = tmp_path / "t.json"
    out = bench(3, "torch-latency", "--min", "1K", "--max", "4K", "--rounds", "1",
                "--json", str(js))
    assert "dist/api" in out, out
    doc = json.loads(js.read_text())
    assert [(r["bytes"], r["dtype"]) for r in doc["results"]] == [
        (1024, "float32"), (1024, "bfloat16"), (4096, "float32"), (4096, "bfloat16")]
    for r in doc["results"]:
        assert all(r[k] > 0 for k in ("api:torch", "dist:commlib", "dist:gloo")), r
        assert (r["api:numpy"] > 0) == (r["dtype"] == "float32"), r


@pytest.mark.long
def test_compression_quality_table_and_plot(tmp_path, capsys):
    """commlib_bench.compression's rows: each compression against the uncompressed run of
    the same seed, the bytes a step, the curves' plot."""
    from commlib_bench import compression
    plot = tmp_path / "curves.png"
    assert compression.main(["--ranks", "2", "--models", "gpt", "--steps", "4", "--seeds",
                             "1", "--runs", "none,int8", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("gpt")]
    assert [r[1].strip() for r in rows] == ["none", "int8"], out
    none_bytes, int8_bytes = (float(r[-1]) for r in rows)
    assert int8_bytes == pytest.approx(none_bytes * (1 + 4 / 64) / 4, rel=0.15), out
    assert plot.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        compression.main(["--runs", "int8,int4"])
    assert "--runs: int4; choose among none" in capsys.readouterr().err

