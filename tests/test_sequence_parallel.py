"""commlib_strategies/megatron_sp.py and context_parallel.py under mpiexec: ring and
Ulysses attention against plain causal attention, the Megatron-SP (tp 2), Ulysses and ring
(cp 2, ring also cp 4) GPTs training like the single-process reference, alone and beside
dp 2 at 4 ranks, and the activation bytes saved per layer against their accounting
(commlib_bench/activations.py)."""
import pytest

from mpirun import run_checked

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_matches_one_process(n):
    out = run_checked(n, "tests/mpi/strategies_sp.py")
    assert "activation bytes saved per layer" in out  # the table, printed by rank 0
