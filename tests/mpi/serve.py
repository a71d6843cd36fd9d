"""A rank of the tests' pool (tests/pool.py): runs tests/mpi scripts one after another in
one launch, so that the scripts share its start-up (importing torch and transformers costs
seconds a rank on 2 cores, often more than the script's cases).

Usage (tests/pool.py starts it): mpiexec -n N python tests/mpi/serve.py DIR
Rank r reads jobs from the FIFO DIR/jobs.r, one JSON line each: {"id", "script", "args",
"env"}. It runs the script as __main__ with those arguments and the launch's environment
updated by "env", its output (file descriptors 1 and 2) going to DIR/<id>.<r>, then puts the
process back as it found it (the world communicator, torch's process group and defaults,
the environment) and writes "<id> <r> <exit code>" to the FIFO DIR/done. A script that
ends with an exception rather than an exit code ends the launch, as it would end its own."""
import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

import commlib
import stacks

directory, rank = Path(sys.argv[1]), MPI.COMM_WORLD.rank


def run(job: dict) -> int:
    """The script's exit code (0 when it returns)."""
    try:
        runpy.run_path(job["script"], run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1


def reset(environ: dict) -> None:
    """The process as before the job: a job's world, process group and torch defaults must
    not reach the next one."""
    torch = sys.modules.get("torch")
    if torch is not None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
        torch.manual_seed(SEED)
    commlib.finalize()
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()  # a job's communicators free their segments


SEED = 67280421310721  # torch's seed in a new process
done = open(directory / "done", "w")
for line in open(directory / f"jobs.{rank}"):
    job, environ = json.loads(line), dict(os.environ)
    os.environ.update(job["env"])
    sys.argv = [job["script"], *job["args"]]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(directory / f"{job['id']}.{rank}", "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    stacks.arm()  # per job, as harness.py's for a launch
    try:
        code = run(job)
        reset(environ)
        stacks.disarm()
        failed = False
    except BaseException:  # noqa: BLE001 - the script's own launch would end here
        traceback.print_exc()
        code, failed = 1, True
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    os.close(saved[0])
    os.close(saved[1])
    done.write(f"{job['id']} {rank} {code}\n")
    done.flush()
    if failed:
        MPI.COMM_WORLD.Abort(1)

# every job file read: end without tearing down each module the jobs imported (seconds)
sys.stdout.flush()
MPI.Finalize()
os._exit(0)
