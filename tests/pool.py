"""Launches shared by tests: ranks started once per world size run tests/mpi scripts one
after another (tests/mpi/serve.py), so that the suite pays a launch's start-up (seconds
with torch or transformers on 2 cores) once per world size, not once per script.

Only scripts in POOLED run here, with environment settings in FRESH (what commlib reads
when a world is made, not when it is imported): the others, and every script that kills
ranks, hangs on purpose, traces, or changes what its process may do, keep launches of their
own (mpirun.mpirun). A job that fails, times out or ends its launch takes the launch down
with it, and the next job starts a new one: a failure cannot leak into another test."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

POOLED = {f"tests/mpi/{name}.py" for name in (
    "async_ops", "cuda_staged", "deterministic", "fast_path", "fuzz", "host_memory", "matrix",
    "misc", "strategies_basics", "strategies_checkpoint", "strategies_families",
    "strategies_moe", "strategies_pp", "strategies_sp", "strategies_tp", "strategies_train",
    "torch_collectives", "torch_errors", "torch_train", "train_many")}
FRESH = {"COMMLIB_TRANSPORT", "COMMLIB_RANKS_PER_HOST", "COMMLIB_SHM_STAGING_BYTES",
         "COMMLIB_DETERMINISTIC", "COMMLIB_CUDA_STREAMS", "COMMLIB_CUDA_IPC",
         "COMMLIB_CUDA_IPC_SLOT_BYTES", "COMMLIB_CUDA_IPC_ONE_SHOT_BYTES",
         "COMMLIB_CUDA_AWARE_MPI", "COMMLIB_TUNING", "XDG_CACHE_HOME"}


def pooled(script: str, env: dict) -> bool:
    """Whether ``script`` with these environment settings may run in a pool."""
    return script in POOLED and set(env) <= FRESH


class Pool:
    """``n`` ranks of tests/mpi/serve.py, and the FIFOs that give them jobs."""

    def __init__(self, n: int, mpiexec: str, env: dict):
        self.n, self.jobs_sent = n, 0
        self.dir = Path(tempfile.mkdtemp(prefix=f"commlib-pool-{n}-"))
        for name in ["done", *(f"jobs.{r}" for r in range(n))]:
            os.mkfifo(self.dir / name)
        # read-write: opening returns at once, and the pool's end never sees end-of-file
        self.done = os.open(self.dir / "done", os.O_RDWR | os.O_NONBLOCK)
        self.jobs = [os.open(self.dir / f"jobs.{r}", os.O_RDWR) for r in range(n)]
        self.log = open(self.dir / "launch", "w")
        self.proc = subprocess.Popen(
            [mpiexec, "-n", str(n), sys.executable, str(ROOT / "tests/mpi/serve.py"),
             str(self.dir)], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=True)
        self.pending = b""

    def run(self, script: str, args: tuple, env: dict, timeout: float):
        """(exit code, or None past ``timeout``; the ranks' output, rank 0 first) of one job;
        the pool is left closed unless the job ended with 0 on every rank."""
        job = self.jobs_sent = self.jobs_sent + 1
        line = json.dumps({"id": job, "script": str(ROOT / script), "args": list(args),
                           "env": env}) + "\n"
        for fd in self.jobs:
            os.write(fd, line.encode())
        codes, deadline = {}, time.monotonic() + timeout
        while len(codes) < self.n and self.proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if select.select([self.done], [], [], min(left, 1.0))[0]:
                self.pending += os.read(self.done, 1 << 16)
                *lines, self.pending = self.pending.split(b"\n")
                for got in lines:
                    got_job, rank, code = map(int, got.split())
                    assert got_job == job, (got_job, job)
                    codes[rank] = code
        outputs = [self.dir / f"{job}.{r}" for r in range(self.n)]
        out = "".join(o.read_text() for o in outputs if o.exists())
        if len(codes) == self.n and not any(codes.values()):
            return 0, out
        timed_out = len(codes) < self.n and self.proc.poll() is None
        out += self.close(kill=timed_out)
        if timed_out:
            return None, f"TIMEOUT after {timeout}s\n{out}"
        if len(codes) == self.n:  # the job's exit codes, not how its launch ended after it
            return max(codes.values(), key=abs), out
        return self.proc.returncode or 1, out

    def hang_up(self) -> None:
        """Close the job files: each rank ends when it has read them to the end."""
        for fd in self.jobs:
            os.close(fd)
        self.jobs = []

    def close(self, kill: bool = False) -> str:
        """End the launch (when its ranks have read their job files to the end, or at once
        where ``kill``: a job is still running) and remove its directory; returns what the
        launch itself printed."""
        self.hang_up()
        try:
            self.proc.wait(timeout=0 if kill else 20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.log.closed:
            return ""
        os.close(self.done)
        self.log.close()
        printed = (self.dir / "launch").read_text()
        shutil.rmtree(self.dir, ignore_errors=True)
        return printed

    @property
    def open(self) -> bool:
        return bool(self.jobs) and self.proc.poll() is None


class Pools:
    """The suite's pools, one per world size, each started when a job first needs it."""

    def __init__(self):
        self.by_size: dict[int, Pool] = {}
        self.dirs: list[str] = []  # of every pool started, open or closed

    def run(self, n: int, script: str, *args: str, timeout: float, env: dict, mpiexec: str,
            launch_env: dict):
        pool = self.by_size.get(n)
        if pool is None or not pool.open:
            if pool is not None:  # its launch ended between jobs
                pool.close()
            pool = self.by_size[n] = Pool(n, mpiexec, launch_env)
            self.dirs.append(str(pool.dir))
        return pool.run(script, args, env, timeout)

    def close(self) -> None:
        for pool in self.by_size.values():  # (the ranks of every pool end side by side)
            pool.hang_up()
        for pool in self.by_size.values():
            pool.close()
        self.by_size.clear()

    def started_here(self, command_line: str) -> bool:
        """Whether the process of ``command_line`` is a rank of a pool this process started."""
        return any(d in command_line.split() for d in self.dirs)


POOLS = Pools()
