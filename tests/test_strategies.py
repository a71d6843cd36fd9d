"""strategies/ under mpiexec: the mesh and the communication mappings at 1-4 ranks, and each
parallel layout training like the single-process reference."""
import pytest

from mpirun import run_checked

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mesh_and_mappings(n):
    run_checked(n, "tests/mpi/strategies_basics.py")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dp_and_zero_train_like_one_process(n):
    run_checked(n, "tests/mpi/strategies_train.py")
