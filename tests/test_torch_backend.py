"""The torch.distributed backend "commlib", under mpiexec with 1-4 ranks: every collective,
DDP and FSDP2 against gloo inside the same processes, the ways to start it; and the same
under torchrun, where the ranks meet through torch's store instead of MPI."""
import re

import pytest

from mpirun import run_checked, torchrun

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3, 4])  # 4: also the 2-D device mesh
def test_collectives_match_gloo(n):
    run_checked(n, "tests/mpi/torch_collectives.py", timeout=240)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ddp_and_fsdp2_train_like_gloo(n):
    out = run_checked(n, "tests/mpi/torch_train.py")
    print(re.search(r"overlap: .*", out).group(0))  # the DDP timeline, for the log


@pytest.mark.parametrize("n", [1, 3])
def test_init_paths(n):
    run_checked(n, "tests/mpi/torch_init.py")


@pytest.mark.parametrize("n", [3])  # (2 ranks under torchrun: the tests below, and 2x2 nodes)
def test_torchrun_collectives_match_gloo(n):
    run_checked(n, "tests/mpi/torch_torchrun.py", launch=torchrun)
    run_checked(n, "tests/mpi/torch_collectives.py", launch=torchrun)


def test_torchrun_ddp_and_fsdp2():
    run_checked(2, "tests/mpi/torch_train.py", launch=torchrun)


@pytest.mark.parametrize("n", [2, 3])
def test_failures_arrive_as_dist_backend_errors(n):
    run_checked(n, "tests/mpi/torch_errors.py")


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


@pytest.mark.skipif(_gpus() == 0, reason="no CUDA device visible (torch.cuda.device_count() == 0)")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_cuda_tensors_collectives_ddp_fsdp2(n):
    """On CUDA tensors, the ranks sharing device 0."""
    run_checked(n, "tests/mpi/torch_cuda.py")
