"""The torch.distributed backend "commlib", under mpiexec with 1-4 ranks: every collective,
DDP and FSDP2 against gloo inside the same processes, the ways to start it; and the same
under torchrun, where the ranks meet through torch's store instead of MPI."""
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from mpirun import checkout_env, mpiexec, run_checked, sizes, torchrun

pytest.importorskip("torch")


@pytest.mark.parametrize("n", sizes(2, 3, 4, long=(2,)))  # 4: also the 2-D device mesh
def test_collectives_match_gloo(n):
    run_checked(n, "tests/mpi/torch_collectives.py", timeout=240)


@pytest.mark.parametrize("n", sizes(2, 3, 4, long=(4,)))
def test_ddp_and_fsdp2_train_like_gloo(n):
    out = run_checked(n, "tests/mpi/torch_train.py")
    print(re.search(r"overlap: .*", out).group(0))  # the DDP timeline, for the log


@pytest.mark.parametrize("n", [1, 3])
def test_compressed_ddp_hook(n):
    """commlib.torch.compression: DDP through compressed all_reduces, every format."""
    out = run_checked(n, "tests/mpi/torch_compressed.py", timeout=300)
    print("\n".join(line for line in out.splitlines() if "loss gap" in line))


@pytest.mark.parametrize("n", [1, 3])
def test_init_paths(n):
    run_checked(n, "tests/mpi/torch_init.py")


def test_torchrun_world():
    run_checked(3, "tests/mpi/torch_torchrun.py", launch=torchrun)


@pytest.mark.long  # (2 ranks under torchrun: the tests below, and 2x2 nodes)
def test_torchrun_collectives_match_gloo():
    run_checked(3, "tests/mpi/torch_collectives.py", launch=torchrun)


@pytest.mark.long  # (under mpiexec: test_ddp_and_fsdp2_train_like_gloo)
def test_torchrun_ddp_and_fsdp2():
    run_checked(2, "tests/mpi/torch_train.py", launch=torchrun)


@pytest.mark.parametrize("n", sizes(2, 4, long=(4,)))  # 4: the 2-D mesh, FSDP2 x TP
def test_torchrun_pytorch_parallelisms_match_gloo(n):
    """DTensor, parallelize_module, FSDP2 x TP, pipelining, functional collectives (eager
    and compiled) on commlib, bitwise as on gloo in the same run."""
    run_checked(n, "tests/mpi/torch_ecosystem.py", launch=torchrun)


@pytest.mark.long
@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_transformers_distributed_config_matches_gloo(n, tmp_path):
    """transformers' own tp, fsdp, tp x ep and fsdp x ep on commlib: losses as one process's
    and, bit for bit, as gloo's (one launch per backend: tests/mpi/transformers_parallel.py)."""
    pytest.importorskip("transformers")
    for backend in ("commlib", "gloo"):
        run_checked(n, "tests/mpi/transformers_parallel.py", backend, str(tmp_path),
                    launch=torchrun)
    losses = {b: json.loads((tmp_path / f"losses-{b}.json").read_text())
              for b in ("commlib", "gloo")}
    assert len(losses["commlib"]) >= 3 and losses["commlib"] == losses["gloo"], losses


def _stopped_job_leaves_nothing(procs, stop, each_prints=1):
    """``procs`` run a job whose ranks print "ready" after a collective, then sleep (each
    process prints ``each_prints`` of them); ``stop(process)`` ends each. /dev/shm must then
    hold nothing that was not there before they started."""
    before = set(os.listdir("/dev/shm"))
    started = [p() for p in procs]
    try:
        for p in started:  # (mpiexec may interleave its ranks' lines)
            out = ""
            while out.count("ready") < each_prints and (line := p.stdout.readline()):
                out += line
            assert out.count("ready") == each_prints, out
        for p in started:
            stop(p)
        for p in started:
            p.wait(30)
    finally:
        for p in started:
            p.kill()
    left = set(os.listdir("/dev/shm")) - before
    assert not left, f"stopping the job left {sorted(left)} in /dev/shm"


_SLEEPING_RANK = """
    import sys, time, torch, torch.distributed as dist, commlib.torch.backend
    if len(sys.argv) > 1:  # the ranks meet through a store
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        dist.init_process_group("commlib", store=store, rank=rank, world_size=2)
    else:  # started by mpiexec
        commlib.torch.backend.init_process_group()
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    assert t[0] == 2
    print("ready", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_store_ranks_leave_nothing_when_stopped(tmp_path, stop):
    """Ranks that meet through a store (as under torchrun), stopped by SIGTERM (as torchrun
    and torch's test suite stop them) or SIGKILL mid-job, leave nothing in /dev/shm (MPICH's
    node segment of each rank's one-process MPI world included)."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_SLEEPING_RANK))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _stopped_job_leaves_nothing(
        [functools.partial(subprocess.Popen, [sys.executable, str(script), str(r), str(port)],
                           stdout=subprocess.PIPE, text=True,
                           env={**os.environ, **checkout_env()}) for r in range(2)],
        lambda p: p.send_signal(stop))


def test_mpi_launched_job_leaves_nothing_when_killed(tmp_path):
    """A job mpiexec started, SIGKILLed whole mid-job (as a scheduler ends it), leaves
    nothing in /dev/shm: not MPICH's node segment, which no rank can unlink after SIGKILL,
    since the backend unlinks it once every rank has mapped it."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_SLEEPING_RANK))
    _stopped_job_leaves_nothing(
        [functools.partial(subprocess.Popen, [mpiexec(), "-n", "2", sys.executable, str(script)],
                           stdout=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, **checkout_env()})],
        lambda p: os.killpg(p.pid, signal.SIGKILL), each_prints=2)


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
