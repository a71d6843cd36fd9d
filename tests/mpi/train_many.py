"""The training CLI (commlib_strategies.train's main) on several layouts in one launch, for
tests/test_strategies.py: each launch costs seconds of start-up on 2 cores.

Usage: mpiexec -n N python tests/mpi/train_many.py LOGDIR ARGS [ARGS ...]: each ARGS one
run's arguments (shell words), logged to LOGDIR/<i>.json"""
import shlex
import sys

from commlib_strategies.train import main

for i, args in enumerate(sys.argv[2:]):
    code = main([*shlex.split(args), "--log", f"{sys.argv[1]}/{i}.json"])
    if code:
        sys.exit(code)
