import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import the mpirun helper
sys.path.insert(0, str(Path(__file__).parent.parent))  # and the bench package

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

import training  # noqa: E402
from pool import POOLS  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def temporary_files_stay_in_the_session(request):
    """What the launches write to the temporary directory (the failure reports of the tests
    that kill ranks on purpose, torch's file stores) goes to a directory of the session's,
    removed at its end unless a test failed, instead of piling up in /tmp. Its path is
    short: sockets are made under it (multiprocessing's forkserver), and a socket's path
    must fit in 108 bytes."""
    where = tempfile.mkdtemp(prefix="commlib-tests-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", where)
        patch.setattr(tempfile, "tempdir", where)
        yield
    if request.session.testsfailed:
        print(f"\nthe launches' temporary files are kept in {where}")
    else:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(temporary_files_stay_in_the_session):
    """After the whole suite: nothing in /dev/shm that was not there before it (commlib's
    segments, the simulated GPU's, anyone's), no rank still running, no namespace host
    (commlib/testing.py) still up; the shared launches end first (and before their
    directories, in the session's temporary one, go)."""
    before = set(Path("/dev/shm").iterdir())
    yield
    POOLS.close()
    mapped = set(Path("/proc/self/maps").read_text().split())  # (this process's MPI's: in use)
    left = sorted(str(p) for p in set(Path("/dev/shm").iterdir()) - before if str(p) not in mapped)
    assert not left, f"left behind in /dev/shm: {left}"
    ranks = subprocess.run(["pgrep", "-af", "tests/mpi/|-m commlib_bench|-m commlib_strategies"
                            "|commlib-hosts-"], capture_output=True, text=True).stdout.splitlines()
    # (a suite run by a test, as test_kernels' baseline run, sees the running suite's pools)
    ranks = [r for r in ranks if "tests/mpi/serve.py" not in r or POOLS.started_here(r)]
    assert not ranks, "processes left running:\n" + "\n".join(ranks)


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """The losses of training.ONE_PROCESS's runs on one rank, by their arguments (one
    launch for the whole session)."""
    return training.one_process_losses(tmp_path_factory.mktemp("one-process"))
