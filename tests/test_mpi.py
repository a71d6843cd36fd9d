"""Multi-rank tests: each script runs under mpiexec with 1, 2, 3 and 4 ranks."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import checkout_env, mpirun, run_checked, sizes

RANKS = [1, 2, 3, 4]


@pytest.mark.parametrize("n", RANKS)
def test_collectives_numpy(n):
    # large counts up to 3 ranks (4 ranks run them on namespace hosts, 2 x 2, and
    # deterministic.py past every piece on shared memory); ordered and the user-defined op
    # in every dtype up to 3 ranks (matrix.py's narrow)
    run_checked(n, "tests/mpi/matrix.py", "numpy", *(["large"] if n < 4 else ["narrow"]))


@pytest.mark.long
def test_collectives_numpy_auto_from_a_measured_table(tmp_path):
    """At 3 ranks, auto chooses from a table measured there (the rest of the suite runs
    without: COMMLIB_TUNING=off, the cost model chooses)."""
    run_checked(3, "tests/mpi/matrix.py", "numpy", "large",
                env={"COMMLIB_TUNING": "on", "XDG_CACHE_HOME": str(tmp_path)})


@pytest.mark.parametrize("n", sizes(*RANKS, long=(3,)))
def test_collectives_numpy_over_mpi_transport(n):
    """The mpi4py executor, as between hosts (large counts at 4 ranks: on namespace hosts;
    ordered and the user-defined op in every dtype at 1 and 2 ranks)."""
    run_checked(n, "tests/mpi/matrix.py", "numpy", *(["large"] if n < 4 else []),
                *(["narrow"] if n > 2 else []), env={"COMMLIB_TRANSPORT": "mpi"})


# (ranks, ranks per virtual host): even hosts offer hier; 3 ranks as 2 + 1 fall back to mpi
# (large counts across hosts run on namespace hosts: tests/test_multihost.py). Here the
# ranks outnumber the cores, where hier's host stages of an all_reduce read in place;
# without one_copy they stage as direct does.
@pytest.mark.parametrize("n,per_host,env", [(2, 1, {}), (3, 1, {}), (3, 2, {}), (4, 2, {}),
                                            (4, 2, {"COMMLIB_ONE_COPY": "0"})], ids=str)
def test_collectives_numpy_on_virtual_hosts(n, per_host, env):
    run_checked(n, "tests/mpi/matrix.py", "numpy", "narrow",
                env={"COMMLIB_RANKS_PER_HOST": str(per_host), **env})


@pytest.mark.parametrize("n", RANKS)
def test_compressed_collectives(n):
    """Every wire format's all_reduce, reduce_scatter and all_gather against a simulation
    of every rank; error feedback across steps (tests/mpi/compressed.py)."""
    run_checked(n, "tests/mpi/compressed.py", timeout=300)


@pytest.mark.parametrize("n", RANKS)
def test_low_rank_averaging(n):
    """PowerSGD's factors: exact on rank-r gradients, equal on every rank, error feedback
    across steps (tests/mpi/low_rank.py)."""
    run_checked(n, "tests/mpi/low_rank.py", timeout=120)


def test_collectives_numpy_with_small_staging():
    """Direct collectives cut into many pieces (4 KiB of staging: 640 bytes per peer in a piece
    of a 3-rank all_to_all), as on a host whose ranks get little shared memory."""
    run_checked(3, "tests/mpi/matrix.py", "numpy", "large", "only=direct",
                env={"COMMLIB_SHM_STAGING_BYTES": "4096"})  # (staging is direct's alone)


@pytest.mark.parametrize("n,call", [(3, "process_vm_readv"), (2, "process_vm_writev")])
def test_one_copy_off_where_the_host_forbids_reading_or_writing_a_peer(n, call):
    """(seccomp, as in Docker's default profile) the staged collectives run instead, and
    set-up says why (broadcast's root writes into its readers: process_vm_writev)."""
    run_checked(n, "tests/mpi/one_copy_forbidden.py", call)


@pytest.mark.parametrize("n,env", [(1, {}), (2, {}), (3, {}), (4, {}),
                                   (3, {"COMMLIB_TRANSPORT": "mpi"})], ids=str)
def test_shared_host_memory(n, env):
    """Communicator.empty and the one_copy collectives reading peers' memory in place
    (ordinary arrays where the ranks share no memory)."""
    pytest.importorskip("torch")
    run_checked(n, "tests/mpi/host_memory.py", env=env)


@pytest.mark.parametrize("n", sizes(*RANKS, long=(3, 4)))
def test_deterministic_mode(n):
    """Every rank-order algorithm on every transport the job can make gives the bits of one
    fold in rank order; with torch (3 ranks): bfloat16 too, and DDP and DataParallel train
    to the same weights whatever the algorithms."""
    run_checked(n, "tests/mpi/deterministic.py", *(["torch"] if n == 3 else []))


@pytest.mark.parametrize("n", sizes(*RANKS, long=(3, 4)))  # (numpy's matrix: all in the default)
def test_collectives_torch(n):
    pytest.importorskip("torch")
    # bfloat16 at the large counts once (3 ranks: uneven chunks); numpy runs the rest of them
    run_checked(n, "tests/mpi/matrix.py", "torch", *(["large"] if n == 3 else []))


@pytest.mark.parametrize("n,env", [(1, {}), (2, {}), (3, {}), (4, {}),
                                   (3, {"COMMLIB_SHM_STAGING_BYTES": "4096"}),
                                   (3, {"COMMLIB_TRANSPORT": "mpi"})],
                         ids=lambda v: str(v))
def test_fast_path(n, env):
    run_checked(n, "tests/mpi/fast_path.py", env=env)


@pytest.mark.parametrize("n", RANKS)
def test_communicators_p2p_selection_errors(n):
    run_checked(n, "tests/mpi/misc.py")


@pytest.mark.parametrize("n", RANKS)
def test_async_collectives_and_p2p(n):
    run_checked(n, "tests/mpi/async_ops.py", timeout=200)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shared_memory_disagreements_fail_on_every_rank(n):
    run_checked(n, "tests/mpi/shm_errors.py", timeout=120)


MISMATCH_RUNS = [(2, {}), (3, {}), (4, {}), (3, {"COMMLIB_TRANSPORT": "mpi"}),
                 (3, {"COMMLIB_RANKS_PER_HOST": "1"}), (4, {"COMMLIB_RANKS_PER_HOST": "2"}),
                 (3, {"COMMLIB_SHM_STAGING_BYTES": "4096"})]


@pytest.mark.parametrize("n,env", MISMATCH_RUNS, ids=lambda v: str(v))
def test_mismatched_calls_raise_on_every_rank(n, env):
    out = run_checked(n, "tests/mpi/mismatch.py", timeout=200, env=env)
    print(re.search(r"mismatch figures.*", out).group(0))  # pytest -s shows the figures


@pytest.mark.parametrize("n,env", [(2, {}), (3, {}), (3, {"COMMLIB_TRANSPORT": "mpi"}),
                                   (4, {"COMMLIB_RANKS_PER_HOST": "2"})], ids=lambda v: str(v))
def test_every_wait_is_bounded(n, env):
    run_checked(n, "tests/mpi/timeouts.py", timeout=200, env=env)


def _segments() -> set:
    return set(Path("/dev/shm").glob("mpich_shm_*")) | set(Path("/dev/shm").glob("commlib-*"))


def test_hung_job_is_killed_with_its_ranks():
    segments = _segments
    before = segments()  # this process has MPI up too, with a segment of its own
    code, out = mpirun(2, "tests/mpi/hang.py", timeout=6)
    assert code is None and "TIMEOUT" in out
    left = subprocess.run(["pgrep", "-f", "tests/mpi/hang.py"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"ranks survived the timeout: {left.stdout}"
    assert segments() <= before, "the killed job left shared memory behind"


def test_an_exception_on_one_rank_ends_the_job_at_once():
    before = _segments()
    start = time.monotonic()
    code, out = mpirun(3, "tests/mpi/raise_on_one_rank.py", timeout=60)
    took = time.monotonic() - start
    assert code not in (None, 0), out[-3000:]
    assert "RuntimeError: deliberate failure on rank 1" in out and "aborting the job" in out, \
        f"exit code {code}, output: {out[-3000:]!r}"
    assert "RETURNED" not in out
    assert took < 30, f"the job took {took:.0f} s to end"  # launch included; no hang
    assert _segments() <= before, "the aborted job left shared memory behind"


@pytest.mark.parametrize("transport", ["shm", "mpi"])
def test_a_killed_rank_ends_the_job_cleanly(transport, tmp_path):
    """The last rank is SIGKILLed inside a collective: the job ends non-zero and promptly,
    leaving no process and no segment. mpiexec (even with -disable-auto-cleanup) kills the
    survivors soon after the death, often before they could raise; what they did report
    must be right (that they raise is the next test's)."""
    before = _segments()
    start = time.monotonic()
    code, out = mpirun(3, "tests/mpi/kill_rank.py", timeout=60, options=("-disable-auto-cleanup",),
                       env={"COMMLIB_TRANSPORT": transport, "COMMLIB_TIMEOUT": "3",
                            "REPORT_DIR": str(tmp_path)})
    took = time.monotonic() - start
    assert code not in (None, 0), out[-3000:]
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))
    for seconds, message in re.findall(r"SURVIVOR rank \d raised after ([\d.]+) s: (.*)", reports):
        assert float(seconds) < 3.5 and "rank 2" in message, message
    assert "RETURNED" not in out
    assert took < 40, f"the job took {took:.0f} s to end"
    left = subprocess.run(["pgrep", "-f", "tests/mpi/kill_rank.py"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"ranks left running: {left.stdout}"
    assert _segments() <= before, "the killed rank left shared memory behind"


def test_a_killed_rank_makes_every_survivor_raise_at_once(tmp_path):
    """Shared memory sees a peer's process gone: with no launcher to kill them (ranks meet
    through a store), both survivors raise within a second, naming the dead rank."""
    pytest.importorskip("torch")
    before = _segments()
    script = str(Path(__file__).parent / "mpi" / "kill_rank_store.py")
    env = {**os.environ, **checkout_env()}
    ranks = [subprocess.Popen([sys.executable, script, str(r), "3", str(tmp_path / "store"),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(3)]
    try:
        outputs = [p.communicate(timeout=60)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert ranks[2].returncode == -signal.SIGKILL, outputs[2][-2000:]
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))
    survivors = re.findall(r"SURVIVOR rank (\d) raised after ([\d.]+) s: (.*)", reports)
    assert sorted(r for r, _, _ in survivors) == ["0", "1"], (reports, outputs)
    for _, seconds, message in survivors:
        assert float(seconds) < 1 and "rank 2" in message and "exited" in message, message
    assert _segments() <= before, "the killed rank left shared memory behind"


@pytest.mark.parametrize("n", sizes(2, 3, 4, long=(3, 4)))
def test_self_tuning_measures_caches_and_agrees(n, tmp_path):
    run_checked(n, "tests/mpi/tuning.py", str(tmp_path), timeout=200)
