"""PyTorch's backend suite on commlib, side by side with gloo (tests/conformance/torch_suite.py).

    python tests/conformance/run.py [--world-sizes 2 3 4] [-k EXPR] [--limit SECONDS]

For each world size, each column in a pytest process of its own, ranks meeting through a
file store:
- ``gloo``: the suite on gloo, the reference;
- ``commlib*``: the suite's gates on the backend's name lifted, every test as for gloo
  (gloo's branches inside tests too), on commlib groups;
- ``commlib``: commlib as a plugin backend (the tests open to plugins, DDP and subgroups),
  run on the tests gloo passes and commlib* does not (a test may check the backend's name);
- ``commlib*/mpi``: the collective tests gloo passes (names matching COLLECTIVE) on ranks
  that mpiexec starts (tests/conformance/mpi_rank.py), whose groups come from MPI.
Each test is bounded by ``--limit`` seconds (its ranks are killed and the test fails).
Prints pass/fail/skip counts per column; the tests that pass on gloo and on no commlib
column, apart from KNOWN (what torch's own library code restricts to gloo); and those
that fail under mpiexec. Writes every outcome as JSON (--out). Exits 1 if either list is
not empty.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SUITE = Path(__file__).with_name("torch_suite.py")
MPI_RANK = Path(__file__).with_name("mpi_rank.py")
MPI_COLUMN = "commlib*/mpi"
COLLECTIVE = re.compile(r"reduce|broadcast|gather|scatter|all_to_all|barrier|send|recv")
COLUMNS = {"gloo": {"BACKEND": "gloo"}, "commlib*": {"BACKEND": "gloo", "COMMLIB_AS_GLOO": "1"},
           "commlib": {"BACKEND": "commlib"}}
# Tests that cannot pass on a backend other than gloo because torch's own library code (not
# the test) refuses it, with why.
KNOWN = {test: "torch's dist.monitored_barrier (distributed_c10d.py) raises ValueError for "
                "any backend but gloo, before any backend is called"
         for test in ("test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
                      "test_monitored_barrier_gloo_rank_0_timeout")}


def run_column(column: str, world_size: int, select: str | None, limit: int) -> dict:
    """{test name: "pass" | "fail" | "skip"} for one column at one world size."""
    with tempfile.TemporaryDirectory(prefix="commlib-conformance-") as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, **COLUMNS[column], "WORLD_SIZE": str(world_size),
               "TEMP_DIR": tmp, "TMPDIR": tmp, "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(limit)}
        # (not tests/conftest.py: the suite's ranks are no launches of commlib's tests)
        command = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider",
                   "--noconftest", f"--junitxml={report}", "-o", "junit_family=xunit1"]
        if select:
            command += ["-k", select]
        subprocess.run(command, env=env, cwd=SUITE.parent, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if not report.exists():
            raise RuntimeError(f"the suite did not run for {column} at world size {world_size}")
        outcomes, failures = {}, []
        for case in ElementTree.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            outcomes[case.get("name")] = ("fail" if kinds & {"failure", "error"} else
                                          "skip" if "skipped" in kinds else "pass")
            failures += [child.text or child.get("message") or "" for child in case
                         if child.tag in ("failure", "error")]
        kinds = list(outcomes.values())
        if column == "gloo" and kinds.count("fail") > kinds.count("pass"):
            # the reference failing: the suite cannot run here, and nothing is compared
            raise RuntimeError(f"gloo, the reference, failed {kinds.count('fail')} tests and "
                               f"passed {kinds.count('pass')} at world size {world_size}; "
                               f"the first failure:\n{failures[0][-3000:]}")
        return outcomes


def run_under_mpiexec(world_size: int, tests: list, limit: int) -> dict:
    """{test: outcome} for ``tests`` on ranks that mpiexec starts (gates lifted), many per
    launch. A launch that stops (a test hung for ``limit`` seconds, or a rank died) fails
    the test it stopped in, and a new one goes on after it; a test that fails in a launch
    runs again alone, which decides (a test before it may have left state behind)."""
    outcomes, left = {}, list(tests)
    while left:
        outcomes.update(launch(world_size, left, limit))
        left = [t for t in tests if t not in outcomes]
    for test in [t for t, o in outcomes.items() if o == "fail"]:
        outcomes.update(launch(world_size, [test], limit))
    return outcomes


def launch(world_size: int, tests: list, limit: int) -> dict:
    """{test: outcome} for ``tests`` run in turn by one mpiexec launch (mpi_rank.py), up to
    the first that does not finish within ``limit`` seconds or ends the ranks (it fails)."""
    from torch.testing._internal.common_distributed import TEST_SKIPS
    skips = {s.exit_code for s in TEST_SKIPS.values()}
    mpiexec = Path(sys.prefix) / "bin" / "mpiexec"
    with tempfile.TemporaryDirectory(prefix="commlib-conformance-") as tmp:
        results = Path(tmp) / "results"
        results.touch()
        env = {**os.environ, **COLUMNS["commlib*"], "WORLD_SIZE": str(world_size),
               "TEMP_DIR": tmp, "TMPDIR": tmp}
        job = subprocess.Popen([str(mpiexec), "-n", str(world_size), sys.executable,
                                str(MPI_RANK), str(results), *tests], env=env,
                               cwd=SUITE.parent, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        done, progressed = 0, time.monotonic()
        while job.poll() is None:
            time.sleep(0.2)
            lines = results.read_text().count("\n")
            if lines > done:
                done, progressed = lines, time.monotonic()
            elif time.monotonic() - progressed > limit:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        outcomes = {}
        for line in results.read_text().split("\n")[:-1]:  # (whole lines only)
            test, code = line.rsplit(" ", 1)
            outcomes[test] = "pass" if code == "0" else "skip" if int(code) in skips else "fail"
    if len(outcomes) < len(tests):
        outcomes[tests[len(outcomes)]] = "fail"
    return outcomes


def passes(results: dict) -> set:
    """The tests that pass on some commlib column run on store ranks."""
    return {t for c in ("commlib*", "commlib") for t, o in results[c].items() if o == "pass"}


def counts(outcomes: dict) -> str:
    return ", ".join(f"{sum(o == kind for o in outcomes.values())} {word}" for kind, word in
                     (("pass", "passed"), ("fail", "failed"), ("skip", "skipped")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    p.add_argument("--limit", type=int, default=60, help="seconds per test (default 60)")
    p.add_argument("--out", type=Path, help="write every outcome here (JSON)")
    args = p.parse_args()
    everything, missing = {}, {}
    for n in args.world_sizes:
        results = {c: run_column(c, n, args.select, args.limit) for c in ("gloo", "commlib*")}
        gloo = {t for t, o in results["gloo"].items() if o == "pass"}
        retry = sorted(gloo - passes({**results, "commlib": {}}))
        results["commlib"] = (run_column("commlib", n, " or ".join(retry), args.limit)
                              if retry else {})
        ours = passes(results)
        collectives = sorted(t for t in gloo if COLLECTIVE.search(t) and t not in KNOWN)
        results[MPI_COLUMN] = run_under_mpiexec(n, collectives, args.limit)
        everything[n] = results
        missing[n] = sorted(gloo - ours - set(KNOWN)) + [
            f"{t} (under mpiexec)" for t, o in results[MPI_COLUMN].items() if o == "fail"]
        print(f"world size {n}: gloo {counts(results['gloo'])}; commlib* "
              f"{counts(results['commlib*'])}; commlib as a plugin, on the {len(retry)} "
              f"others gloo passes: {counts(results['commlib'])}; commlib {len(ours)} passed "
              f"in all; under mpiexec, on {len(collectives)} collective tests: "
              f"{counts(results[MPI_COLUMN])}", flush=True)
        better = sorted(ours - gloo)
        if better:
            print(f"  passes on commlib, not on gloo: {', '.join(better)}")
        if missing[n]:
            print(f"  passes on gloo, not on commlib: {', '.join(missing[n])}")
    for test, why in KNOWN.items():
        print(f"  known: {test}: {why}")
    if args.out:
        args.out.write_text(json.dumps(everything, indent=1, sort_keys=True))
    return 1 if any(missing.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
