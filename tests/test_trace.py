"""commlib.trace: every rank's calls merged into one Chrome trace (tests/mpi/trace_run.py
under COMMLIB_TRACE, one rank in a time namespace whose clock runs 1000 s ahead, as if on
another host)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT, checkout_env, mpiexec, run_command

AHEAD = 1000.0  # seconds rank 1's monotonic clock is ahead


def _merge(*args):
    return subprocess.run([sys.executable, "-m", "commlib.trace", *args], capture_output=True,
                          text=True, env={**checkout_env(), "PATH": "/usr/bin:/bin"},
                          cwd=ROOT, timeout=60)


def test_trace_merges_every_rank_on_one_clock(tmp_path):
    script = [sys.executable, str(ROOT / "tests/mpi/trace_run.py")]
    ahead = ["unshare", "--time", "--fork", "--monotonic", str(int(AHEAD))]
    probe = subprocess.run(ahead + ["true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no time namespaces here: {probe.stderr.decode()[:200]}")
    cmd = [mpiexec(), "-n", "1", *script, ":", "-n", "1", *ahead, *script, ":",
           "-n", "1", *script]
    code, out = run_command(cmd, 120, {**checkout_env(), "COMMLIB_TRACE": str(tmp_path)})
    assert code == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r:05d}.json").read_text()) for r in range(3)]
    assert ranks[1]["offset"] == pytest.approx(AHEAD, abs=0.1)
    assert abs(ranks[2]["offset"]) < 0.1 and ranks[0]["offset"] == 0.0

    done = _merge(str(tmp_path), "-o", str(tmp_path / "trace.json"), "--png",
                  str(tmp_path / "trace.png"))
    assert done.returncode == 0, done.stderr
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events if e["name"] == "process_name"} == {0, 1, 2}
    calls = [e for e in events if e["ph"] == "X"]
    world = {r: [(e["args"]["seq"], e["name"]) for e in calls if e["pid"] == r and e["tid"] == 0]
             for r in range(3)}  # (tid 0: the world, 1: the split communicator, 2: regions)
    # the same calls in the same order on every rank: 3 small all_reduces (fast path), a
    # ring all_reduce, barrier, broadcast, all_gather, barrier
    assert world[0] == world[1] == world[2], world
    names = [name for _, name in world[0]]
    assert names.count("all_reduce") == 5 and names.count("barrier") == 2, names
    assert [seq for seq, _ in world[0]] == sorted(seq for seq, _ in world[0])
    assert all(e["args"]["bytes"] == 4000 for e in calls if e["name"] == "all_gather")
    # on rank 0's clock no rank ends a call before every rank has started it
    for seq, name in world[0]:
        if name in ("all_reduce", "barrier", "all_gather"):
            ours = [e for e in calls if e["tid"] == 0 and e["args"]["seq"] == seq]
            latest_start = max(e["ts"] for e in ours)
            earliest_end = min(e["ts"] + e["dur"] for e in ours)
            assert latest_start <= earliest_end + 10e3, (name, seq, ours)  # 10 ms slack
    # the split communicator: a thread of its own on every rank; then the regions' row
    assert all(any(e["tid"] == 1 for e in calls if e["pid"] == r) for r in range(3))
    regions = [e for e in calls if e["cat"] == "region"]
    assert sorted((e["pid"], e["tid"], e["name"]) for e in regions) == \
        [(r, 2, "overlap") for r in range(3)]
    for r in range(3):  # the async all_gather lies inside its rank's region
        inside = [e for e in calls if e["pid"] == r and e["name"] == "all_gather"]
        (mark,) = [e for e in regions if e["pid"] == r]
        assert mark["ts"] <= inside[0]["ts"] <= mark["ts"] + mark["dur"]
    if (tmp_path / "trace.png").exists():
        assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"
    # whom each rank waited for: rank 1 slept 0.2 s before the world's 80-byte all_reduce
    # (its clock 1000 s ahead: the offsets measured at set-up put it right)
    for e in calls:
        if e["tid"] == 0 and e["name"] == "all_reduce" and e["args"]["bytes"] == 80:
            if e["pid"] == 1:
                assert e["args"]["waited_us"] < 50e3, e["args"]
            else:
                assert e["args"]["waited_for"] == 1 and e["args"]["waited_us"] > 150e3, e
    # hosts without a shared file system: each one's directory, merged by naming them all
    other = tmp_path / "other-host"
    other.mkdir()
    (tmp_path / "rank-00001.json").rename(other / "rank-00001.json")
    done = _merge(str(tmp_path), str(other), "-o", str(tmp_path / "again.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "again.json").read_text()) == trace


def test_a_trace_window(tmp_path):
    """commlib.trace.tracing around part of a run, without COMMLIB_TRACE."""
    code, out = run_command([mpiexec(), "-n", "3", sys.executable,
                             str(ROOT / "tests/mpi/trace_window.py"), str(tmp_path)], 120,
                            checkout_env())
    assert code == 0, out[-3000:]


def test_trace_merge_errors(tmp_path):
    done = _merge(str(tmp_path))
    assert done.returncode == 2 and "no rank-*.json in" in done.stderr, done.stderr
    (tmp_path / "rank-00000.json").write_text(json.dumps(
        {"rank": 0, "size": 2, "host": "h", "pid": 1, "offset": 0.0, "communicators": []}))
    done = _merge(str(tmp_path))
    assert done.returncode == 2 and "a rank did not write its trace" in done.stderr


def test_a_failure_writes_every_failed_ranks_last_calls():
    """A disagreement: each rank's error names one merged timeline of the ranks that
    answered; merged again, it holds every rank's failed call."""
    code, out = run_command([mpiexec(), "-n", "3", sys.executable,
                             str(ROOT / "tests/mpi/trace_failure.py")], 120, checkout_env())
    assert code == 0, out[-3000:]
    notes = _notes(out, 3)
    assert sorted(int(rank) for rank, _, _ in notes) == [0, 1, 2], out[-3000:]
    (path,) = {p for _, _, p in notes}
    assert json.loads(open(path).read())["traceEvents"]
    done = _merge(os.path.dirname(path), "-o", path)
    assert done.returncode == 0, done.stderr
    trace = json.loads(open(path).read())
    failed = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["state"] == "failed"]
    assert {e["pid"] for e in failed} == {0, 1, 2}
    assert all("do not match" in e["args"]["error"] for e in failed)
    shutil.rmtree(os.path.dirname(path))


def _notes(out: str, ranks: int) -> list:
    """(rank, ranks that answered, path) of each failing rank's note."""
    return re.findall(rf"rank (\d): commlib: the last calls of the (\d) of {ranks} ranks that "
                      r"answered: (\S+trace\.json)", out)


def test_a_failure_shows_every_rank_that_answers(tmp_path):
    """Ranks 0 and 1 time out while rank 2 is in no call: their timeline holds rank 2's
    last calls, every rank on rank 0's clock (rank 1's runs 1000 s ahead); rank 2 stopped
    (SIGSTOP) does not answer, and the note says so."""
    script = [sys.executable, str(ROOT / "tests/mpi/trace_stuck.py")]
    ahead = ["unshare", "--time", "--fork", "--monotonic", str(int(AHEAD))]
    if subprocess.run(ahead + ["true"], capture_output=True).returncode:
        ahead = []  # (no time namespaces here: the clocks agree already)
    env = {**checkout_env(), "TMPDIR": str(tmp_path)}
    cmd = [mpiexec(), "-n", "1", *script, "sleep", ":", "-n", "1", *ahead, *script, "sleep",
           ":", "-n", "1", *script, "sleep"]
    code, out = run_command(cmd, 120, env)
    assert code == 0, out[-3000:]
    notes = _notes(out, 3)
    assert sorted(int(rank) for rank, _, _ in notes) == [0, 1] and \
        {answered for _, answered, _ in notes} == {"3"}, out[-3000:]
    (path,) = {p for _, _, p in notes}
    where = os.path.dirname(path)
    offsets = [json.loads(open(f"{where}/rank-{r:05d}.json").read())["offset"] for r in range(3)]
    assert offsets[0] == 0.0 and abs(offsets[2]) < 0.1, offsets
    assert offsets[1] == pytest.approx(AHEAD if ahead else 0.0, abs=0.1), offsets
    events = [e for e in json.loads(open(path).read())["traceEvents"] if e["ph"] == "X"]
    (broadcast,) = [e for e in events if e["name"] == "broadcast"]
    assert broadcast["pid"] == 2 and broadcast["tid"] != 0  # on its own communicator
    failed = [e for e in events if e["args"]["state"] == "failed"]
    assert sorted(e["pid"] for e in failed) == [0, 1], failed
    agreed = [e["ts"] for e in events if e["name"] == "all_reduce" and e["args"]["bytes"] == 32]
    assert len(agreed) == 3 and max(agreed) - min(agreed) < 0.1e6, agreed  # (microseconds)

    shutil.rmtree(where)
    code, out = run_command([mpiexec(), "-n", "3", *script, "stop"], 120, env)
    assert code == 0, out[-3000:]
    notes = _notes(out, 3)
    assert sorted(int(rank) for rank, _, _ in notes) == [0, 1], out[-3000:]
    assert all(answered == "2" for _, answered, _ in notes), notes
    assert "no answer from rank 2 (dead, stopped, or holding the interpreter)" in out, out[-3000:]
