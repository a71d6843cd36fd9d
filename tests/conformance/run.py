"""PyTorch's backend suite on commlib, side by side with gloo (tests/conformance/torch_suite.py).

    python tests/conformance/run.py [--world-sizes 2 3 4] [-k EXPR] [--limit SECONDS]

For each world size it runs the suite three times, each in a pytest process of its own:
``gloo``; ``commlib`` (as a plugin backend: the tests open to plugins, DDP and
subgroups); ``commlib*`` (the suite's gates on the backend's name lifted: every test as for
gloo, on commlib groups). Each test is bounded by ``--limit`` seconds (the suite's own
timeout: its ranks are killed and the test fails). Prints pass/fail/skip counts per column
and the tests that pass on gloo but on neither commlib column, apart from KNOWN (tests
torch's own library code restricts to gloo), and writes every outcome as JSON (--out).
Exits 1 if that list is not empty.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SUITE = Path(__file__).with_name("torch_suite.py")
COLUMNS = {"gloo": {"BACKEND": "gloo"}, "commlib": {"BACKEND": "commlib"},
           "commlib*": {"BACKEND": "gloo", "COMMLIB_AS_GLOO": "1"}}
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
               "TEMP_DIR": tmp, "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(limit)}
        command = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}", "-o", "junit_family=xunit1"]
        if select:
            command += ["-k", select]
        subprocess.run(command, env=env, cwd=SUITE.parent, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if not report.exists():
            raise RuntimeError(f"the suite did not run for {column} at world size {world_size}")
        outcomes = {}
        for case in ElementTree.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            outcomes[case.get("name")] = ("fail" if kinds & {"failure", "error"} else
                                          "skip" if "skipped" in kinds else "pass")
        return outcomes


def compare(results: dict) -> list[str]:
    """Tests that pass on gloo and on neither commlib column (KNOWN aside)."""
    gloo, plugin, lifted = (results[c] for c in COLUMNS)
    return sorted(t for t, o in gloo.items() if o == "pass" and t not in KNOWN
                  and plugin.get(t) != "pass" and lifted.get(t) != "pass")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    p.add_argument("--limit", type=int, default=60, help="seconds per test (default 60)")
    p.add_argument("--out", type=Path, help="write every outcome here (JSON)")
    args = p.parse_args()
    everything, missing = {}, {}
    for n in args.world_sizes:
        results = {c: run_column(c, n, args.select, args.limit) for c in COLUMNS}
        everything[n] = results
        missing[n] = compare(results)
        print(f"world size {n}: " + "; ".join(
            f"{c} {sum(o == 'pass' for o in r.values())} passed, "
            f"{sum(o == 'fail' for o in r.values())} failed, "
            f"{sum(o == 'skip' for o in r.values())} skipped" for c, r in results.items()),
            flush=True)
        better = sorted(t for t, o in results["gloo"].items() if o != "pass" and "pass" in
                        (results["commlib"].get(t), results["commlib*"].get(t)))
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
