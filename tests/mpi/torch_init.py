"""Ways to start the "commlib" backend under mpiexec: torch's own init_process_group with an
init_method (tcp:// and file://), commlib.torch.backend.init_process_group() again after
a destroy, and torch ranks that disagree with MPI's, which must be refused clearly."""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
from mpi4py import MPI

import commlib.torch.backend as tb
from harness import Checker

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, n = world.rank, world.size
check = Checker()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def works(expected_backend="commlib"):
    assert dist.get_backend() == expected_backend
    assert (dist.get_rank(), dist.get_world_size()) == (rank, n)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n - 1) / 2] * 3
    sub = dist.new_group([0])
    if rank == 0:
        u = torch.ones(2)
        dist.all_reduce(u, group=sub)
        assert u.tolist() == [1.0, 1.0]


def torch_rank_must_match_mpi():
    if n < 2:
        return
    path = world.bcast(tempfile.mktemp(prefix="commlib-init-") if rank == 0 else None)
    try:
        dist.init_process_group("commlib", rank=n - 1 - rank, world_size=n,
                                init_method=f"file://{path}")
        raise AssertionError("swapped ranks accepted")
    except RuntimeError as e:
        assert "MPI.COMM_WORLD" in str(e) and "rank" in str(e), str(e)
    assert not dist.is_initialized()
    world.Barrier()
    if rank == 0 and os.path.exists(path):
        os.unlink(path)


def standard_tcp_init():
    port = world.bcast(free_port() if rank == 0 else None)
    dist.init_process_group("commlib", rank=rank, world_size=n,
                            init_method=f"tcp://127.0.0.1:{port}")
    works()
    dist.destroy_process_group()


def standard_file_init():
    path = world.bcast(tempfile.mktemp(prefix="commlib-init-") if rank == 0 else None)
    dist.init_process_group("commlib", rank=rank, world_size=n, init_method=f"file://{path}")
    works()
    dist.destroy_process_group()
    world.Barrier()
    if rank == 0 and os.path.exists(path):
        os.unlink(path)


def helper_init_twice():
    for _ in range(2):
        tb.init_process_group()
        works()
        dist.destroy_process_group()


def registered():
    assert "commlib" in dist.Backend.backend_list
    assert dist.Backend("commlib") == "commlib"


for case in (registered, torch_rank_must_match_mpi, standard_tcp_init, standard_file_init,
             helper_init_twice):
    check.check(case.__name__, case)
    world.Barrier()  # a failed case must not leave ranks behind in the next one
check.finish()
