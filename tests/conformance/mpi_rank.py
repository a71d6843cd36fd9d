"""One test of PyTorch's backend suite on ranks that mpiexec started, so that the group comes
from MPI (the transports and algorithms of an MPI world) rather than from a store:

    mpiexec -n N python tests/conformance/mpi_rank.py TEST_NAME

Each rank runs the test as torch_suite.py's spawned ranks do (TestDistBackend._run: it
joins the group, runs the test, exits 0, or a skip's code, or 10 on failure). TEMP_DIR must
hold the directories barrier/, test_dir/ and init_dir/ (run.py makes them), and
BACKEND=commlib, or BACKEND=gloo with COMMLIB_AS_GLOO=1."""
import os
import sys

import torch.multiprocessing as mp
from mpi4py import MPI

from torch_suite import TestDistBackendWithSpawn

ours, _theirs = mp.Pipe()  # (where a spawned rank reports its error to the parent)
TestDistBackendWithSpawn._run(
    MPI.COMM_WORLD.rank, sys.argv[1],
    os.path.join(os.environ["TEMP_DIR"], "init_dir", "shared_init_file"), ours)
