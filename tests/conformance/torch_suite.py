"""PyTorch's own backend suite (torch/testing/_internal/distributed/distributed_test.py,
the tests gloo and NCCL run), on the backend that BACKEND names, as upstream's
test/distributed/test_distributed_spawn.py runs it: each test spawns WORLD_SIZE ranks that
meet through a file store under TEMP_DIR. Run by tests/conformance/run.py, one pytest
process per backend and world size.

BACKEND=commlib declares commlib a plugin that does DDP and subgroups (DistTestCases'
feature sets), so the tests open to such plugins run. COMMLIB_AS_GLOO=1 (with
BACKEND=gloo) lifts the suite's gates on the backend's name: every test runs as for gloo,
gloo's branches inside tests included, but every group is a commlib group
(init_process_group and new_group take "commlib" where "gloo" is asked for).
"""
import os

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases
from torch.testing._internal.common_utils import run_tests

import commlib.torch.backend  # noqa: F401 (registers "commlib" in every rank: they import this)

if os.environ["BACKEND"] == "commlib":
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("commlib")

if os.environ.get("COMMLIB_AS_GLOO") == "1":
    def _as_commlib(function):
        def call(*args, backend=None, **kwargs):
            if backend is None or str(backend).lower() == "gloo":
                backend = "commlib"
            return function(*args, backend=backend, **kwargs)
        return call

    dist.init_process_group = _as_commlib(dist.init_process_group)
    dist.new_group = _as_commlib(dist.new_group)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)


# Ranks start from a fork server that has imported torch and torch's test modules (nothing
# that touches MPI), each then importing this module: as spawned ranks are, without
# importing all that each time (4x faster). The suite itself only where this module changes
# nothing it reads at import (BACKEND=gloo; DistTestCases' feature sets are changed above).
_SERVER = torch.multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(
    ["torch", "torch.testing._internal.common_distributed",
     *(["torch.testing._internal.distributed.distributed_test"]
       if os.environ["BACKEND"] == "gloo" else [])])


def _in_environment(environment: dict, target, args, **kwargs):
    os.environ.clear()
    os.environ.update(environment)
    target(*args, **kwargs)


class _Rank(_SERVER.Process):
    """A rank with its parent's environment as it is now (the suite sets TEMP_DIR and
    INIT_METHOD per test, after the fork server started)."""

    def __init__(self, target, name, args, kwargs):
        super().__init__(target=_in_environment, name=name, args=(dict(os.environ), target, args),
                         kwargs=kwargs)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(_Rank)


if __name__ == "__main__":
    run_tests()
