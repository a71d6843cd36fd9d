"""Tests of PyTorch's backend suite on ranks that mpiexec started, so that the group comes
from MPI (the transports and algorithms of an MPI world) rather than from a store:

    mpiexec -n N python tests/conformance/mpi_rank.py RESULTS TEST_NAME...

The tests run in turn in these processes (a launch costs more than most tests): each as
torch_suite.py's spawned ranks run one (TestDistBackend._run joins the group, runs the test,
leaves the group and exits 0, a skip's code, or 10 on failure), in a fresh directory beside
RESULTS holding barrier/, test_dir/ and init_dir/. After each test rank 0 appends
``TEST CODE`` to RESULTS, the ranks' worst code (a failure's over a skip's over 0), so that
run.py sees how far the launch got when a test hangs and it kills the ranks. BACKEND must
be commlib, or gloo with COMMLIB_AS_GLOO=1."""
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp
from mpi4py import MPI
from torch.testing._internal.common_distributed import TEST_SKIPS
from torch.testing._internal.distributed import distributed_test

from torch_suite import TestDistBackendWithSpawn

SKIPS = {skip.exit_code for skip in TEST_SKIPS.values()}
world = MPI.COMM_WORLD
results, tests = sys.argv[1], sys.argv[2:]


def run(test: str, temp: str) -> int:
    """The exit code of one rank running ``test`` with its files under ``temp``."""
    os.environ["TEMP_DIR"] = temp
    init_file = os.path.join(temp, "init_dir", "shared_init_file")
    distributed_test.INIT_METHOD = f"file://{init_file}"  # (tests that join again read it)
    if dist.is_initialized():  # a failed test leaves its group behind
        dist.destroy_process_group()
    ours, _theirs = mp.Pipe()  # (where a spawned rank reports its error to the parent)
    try:
        TestDistBackendWithSpawn._run(world.rank, test, init_file, ours)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        return 1
    return 0


for i, test in enumerate(tests):
    temp = os.path.join(os.path.dirname(os.path.abspath(results)), f"test{i}")
    if world.rank == 0:
        for part in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp, part))
    world.Barrier()
    codes = world.gather(run(test, temp))
    if world.rank == 0:
        failed = [c for c in codes if c != 0 and c not in SKIPS]
        skipped = [c for c in codes if c in SKIPS]
        with open(results, "a") as out:
            out.write(f"{test} {(failed or skipped or [0])[0]}\n")
