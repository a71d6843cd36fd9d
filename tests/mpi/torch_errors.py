"""Through torch.distributed, commlib's failures arrive as torch reports backend failures:
DistBackendError (which is also the commlib error: CollectiveMismatchError,
CommTimeoutError), synchronously or from wait(); the group's timeout bounds collectives.

Usage: mpiexec -n N python tests/mpi/torch_errors.py   (N >= 2)
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import commlib
import commlib.torch.backend as tb
from harness import Checker

tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
check = Checker()


def mismatch_is_a_dist_backend_error():
    group = dist.new_group()
    for async_op, seen in ((False, False), (True, False), (False, True)):
        if seen:  # both calls seen by every rank: the mismatched one runs at once (fast path)
            for count in (4, 5, 4, 5):
                dist.all_reduce(torch.ones(count), group=group)
        t = torch.ones(4 + (rank == n - 1))
        try:
            work = dist.all_reduce(t, group=group, async_op=async_op)
            if async_op:
                work.wait()
        except dist.DistBackendError as e:
            assert isinstance(e, commlib.CollectiveMismatchError), type(e).__mro__
            assert "count" in str(e), e
        else:
            raise AssertionError("no DistBackendError")
        group = dist.new_group()  # the mismatch ended that one


def the_groups_timeout_bounds_its_collectives():
    group = dist.new_group(timeout=timedelta(seconds=0.5))
    for _ in range(2):  # seen: rank 0's call below runs at once (the fast path)
        dist.all_reduce(torch.ones(1000), group=group)
    start = time.monotonic()
    try:
        if rank == 0:
            try:
                dist.all_reduce(torch.ones(1000), group=group)
            except dist.DistBackendError as e:
                assert isinstance(e, commlib.CommTimeoutError), type(e).__mro__
                assert "timed out" in str(e) and "rank 1" in str(e), e
                assert time.monotonic() - start < 5
            else:
                raise AssertionError("no DistBackendError")
    finally:
        dist.barrier()


if n >= 2:
    check.run_cases(globals())
check.finish()
