"""commlib_strategies/tensor_parallel.py under mpiexec: each tensor-parallel layer and the
vocab-parallel loss against one process, and the tensor-parallel GPT (alone, and as tp=2
inside dp x tp) training like the single-process reference."""
import pytest

from mpirun import run_checked

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_matches_one_process(n):
    run_checked(n, "tests/mpi/strategies_tp.py")
