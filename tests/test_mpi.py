"""Multi-rank tests: each script runs under mpiexec with 1, 2, 3 and 4 ranks."""
import re
import subprocess
from pathlib import Path

import pytest

from mpirun import mpirun

RANKS = [1, 2, 3, 4]


def run_checked(n, script, *args, timeout=400):
    code, out = mpirun(n, script, *args, timeout=timeout)
    summary = re.search(r"commlib-check: (\d+) cases, (\d+) failures", out)
    assert code == 0 and summary, f"mpiexec -n {n} {script} {' '.join(args)} exited {code}:\n{out[-6000:]}"
    assert int(summary.group(1)) > 0 and int(summary.group(2)) == 0


@pytest.mark.parametrize("n", RANKS)
def test_collectives_numpy(n):
    run_checked(n, "tests/mpi/matrix.py", "numpy", "large")


@pytest.mark.parametrize("n", RANKS)
def test_collectives_torch(n):
    pytest.importorskip("torch")
    run_checked(n, "tests/mpi/matrix.py", "torch", "large")


@pytest.mark.parametrize("n", RANKS)
def test_communicators_p2p_selection_errors(n):
    run_checked(n, "tests/mpi/misc.py")


@pytest.mark.parametrize("n", RANKS)
def test_async_collectives_and_p2p(n):
    run_checked(n, "tests/mpi/async_ops.py", timeout=200)


def test_hung_job_is_killed_with_its_ranks():
    segments = lambda: set(Path("/dev/shm").glob("mpich_shm_*"))  # noqa: E731
    before = segments()  # this process has MPI up too, with a segment of its own
    code, out = mpirun(2, "tests/mpi/hang.py", timeout=10)
    assert code is None and "TIMEOUT" in out
    left = subprocess.run(["pgrep", "-f", "tests/mpi/hang.py"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"ranks survived the timeout: {left.stdout}"
    assert segments() <= before, "the killed job left shared memory behind"
