"""Across real hosts: namespace hosts on this machine (commlib/testing.py), each with its
own network stack, hostname, /dev/shm and pids, joined over TCP, mpiexec starting ranks on
them as over ssh. The layouts: 2x1, 2x2, 3x1 and an uneven 2+1. After every job, nothing
may be left on any host (no rank, no /dev/shm file). Run just these with
``python -m pytest -m multihost``; they skip, saying why, where namespaces cannot be made
(not root, no unshare)."""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commlib.testing import NamespaceHosts, usable
from mpirun import (checkout_env, on_hosts, run_checked, run_command,
                    torchrun_on_hosts)
from training import RUN, losses

pytestmark = [pytest.mark.multihost, pytest.mark.long,
              pytest.mark.skipif(usable() is not None, reason=str(usable()))]
LAYOUTS = [[1, 1], [2, 2], [1, 1, 1], [2, 1]]


@pytest.fixture(scope="module")
def hosts():
    with NamespaceHosts(3) as h:
        yield h


@pytest.mark.parametrize("per_host", LAYOUTS, ids=str)
def test_collective_matrix(hosts, per_host):
    """Every collective, dtype, op and algorithm (hier among them where the layout is
    even; ordered and the user-defined op in float32: matrix.py's narrow); the transport
    must be the one the real layout calls for."""
    start = time.monotonic()
    # (3 hosts x 1 and 2 + 1 run the mpi transport, whose large counts over 3 ranks the
    # one-host runs give it; every dtype and op of the large counts too, but not over TCP)
    large = ["large-float32"] if per_host in ([1, 1], [2, 2]) else []
    out = run_checked(sum(per_host), "tests/mpi/matrix.py", "numpy", *large, "narrow",
                      launch=on_hosts(hosts, per_host), timeout=400)
    print(per_host, f"{time.monotonic() - start:.1f} s", out.splitlines()[-1])


def test_collective_matrix_torch(hosts):
    """torch tensors (bfloat16 among the dtypes), uneven chunks over 3 hosts."""
    run_checked(3, "tests/mpi/matrix.py", "torch", "narrow", launch=on_hosts(hosts, [1, 1, 1]))


def test_deterministic_mode_across_hosts(hosts):
    """The rank-order algorithms on the hosts and mpi transports give the bits of one fold."""
    run_checked(4, "tests/mpi/deterministic.py", launch=on_hosts(hosts, [2, 2]), timeout=200)


@pytest.mark.parametrize("per_host", [[1, 1], [2, 1]], ids=str)
def test_disagreements_raise_on_every_rank(hosts, per_host):
    out = run_checked(sum(per_host), "tests/mpi/mismatch.py", launch=on_hosts(hosts, per_host),
                      timeout=200)
    print(re.search(r"mismatch figures.*", out).group(0))


def test_every_wait_is_bounded(hosts):
    run_checked(4, "tests/mpi/timeouts.py", launch=on_hosts(hosts, [2, 2]), timeout=200)


@pytest.mark.parametrize("per_host", [[2, 1], [1, 1, 1]], ids=str)
def test_a_rank_killed_on_another_host_ends_the_job(hosts, per_host, tmp_path):
    """The last rank, alone on its host, is SIGKILLed inside a collective: the job ends
    non-zero and promptly, and nothing is left on any host (on_hosts checks)."""
    start = time.monotonic()
    code, out = on_hosts(hosts, per_host)(
        sum(per_host), "tests/mpi/kill_rank.py", timeout=60, options=("-disable-auto-cleanup",),
        env={"COMMLIB_TIMEOUT": "3", "REPORT_DIR": str(tmp_path)})
    took = time.monotonic() - start
    assert code not in (None, 0), out[-3000:]
    assert "RETURNED" not in out
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))
    for seconds, message in re.findall(r"SURVIVOR rank \d raised after ([\d.]+) s: (.*)", reports):
        assert float(seconds) < 3.5 and f"rank {sum(per_host) - 1}" in message, message
    assert took < 40, f"the job took {took:.0f} s to end"


@pytest.fixture(scope="module")
def shaped_hosts():
    """Two hosts whose links carry 1 Gbit/s, as a user's do (the wire bounds a transfer)."""
    with NamespaceHosts(2, link="1gbit") as h:
        yield h


@pytest.mark.parametrize("per_host", [[1, 1], [2, 2]], ids=str)
def test_async_collectives_move_while_the_caller_computes(shaped_hosts, per_host):
    """tests/mpi/overlap.py: an async all_reduce's result lands while its caller runs a
    pure-Python loop or a torch matmul, and its progress thread spends little of the core
    (net between the hosts, and hier: shared memory inside them)."""
    out = run_checked(sum(per_host), "tests/mpi/overlap.py",
                      launch=on_hosts(shaped_hosts, per_host), timeout=200)
    print("\n".join(line for line in out.splitlines() if "landed" in line or "matmul" in line))


def test_strategies_and_torch_train_alike_across_a_shaped_link(shaped_hosts, tmp_path,
                                                              one_process):
    """Over 1 Gbit/s links, where communication runs beside compute: commlib-train's DP
    and ZeRO-1/2/3 print the single-process run's losses (one launch: train_many), and
    torch's DDP and FSDP2 on the commlib backend train like gloo."""
    runs = [(*RUN, "--dp", "2", *(["--zero", str(z)] if z else [])) for z in range(4)]
    code, out = on_hosts(shaped_hosts, [1, 1])(
        2, "tests/mpi/train_many.py", str(tmp_path), *map(shlex.join, runs), timeout=300,
        env=checkout_env())
    assert code == 0, out[-4000:]
    for i, args in enumerate(runs):
        got = losses(json.loads((tmp_path / f"{i}.json").read_text()))
        assert got == pytest.approx(one_process[RUN], rel=1e-5), (args, got, one_process[RUN])
    run_checked(2, "tests/mpi/torch_train.py", launch=on_hosts(shaped_hosts, [1, 1]),
                timeout=300)


def test_a_rank_killed_mid_overlap_fails_every_survivor(shaped_hosts, tmp_path):
    """The last rank is SIGKILLed while an async all_reduce is on the wire (1 Gbit/s) and
    its peers compute: each survivor's wait raises CommError naming it at once (its
    connection closed), the job ends, and nothing is left on either host."""
    start = time.monotonic()
    code, out = on_hosts(shaped_hosts, [1, 1])(
        2, "tests/mpi/kill_rank.py", "async", timeout=60, options=("-disable-auto-cleanup",),
        env={"COMMLIB_TIMEOUT": "30", "REPORT_DIR": str(tmp_path)})
    assert code not in (None, 0), out[-3000:]
    assert "RETURNED" not in out
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))
    found = re.findall(r"SURVIVOR rank \d raised after ([\d.]+) s: (.*)", reports)
    assert found, (reports, out[-3000:])
    for seconds, message in found:
        assert float(seconds) < 5 and "rank 1" in message, message
    assert time.monotonic() - start < 40


def test_torch_backend_collectives_and_ddp_like_gloo(hosts):
    """The torch backend's store and groups across hosts: every collective against gloo
    (2 + 1 ranks), DDP and FSDP2 training like gloo (2 x 1)."""
    run_checked(3, "tests/mpi/torch_collectives.py", launch=on_hosts(hosts, [2, 1]), timeout=300)
    run_checked(2, "tests/mpi/torch_train.py", launch=on_hosts(hosts, [1, 1]), timeout=300)


def test_training_dp_across_hosts_tp_inside_them(hosts, tmp_path, one_process):
    """The strategies' CLI at dp 2 x tp 2 (tp's ranks on one host, dp's across the two)
    prints the single-process run's losses."""
    log = tmp_path / "log.json"
    code, out = on_hosts(hosts, [2, 2])(4, "-m", "commlib_strategies.train", *RUN, "--dp", "2",
                                        "--tp", "2", "--sp", "megatron", "--log", str(log),
                                        timeout=300, env=checkout_env())
    assert code == 0, out[-4000:]
    got = losses(json.loads(log.read_text()))
    assert got == pytest.approx(one_process[RUN], rel=1e-5), (got, one_process[RUN])


def test_survivors_of_a_lost_host_shrink_and_go_on(hosts, tmp_path):
    """4 ranks on 2 hosts (2 + 2) meeting through a file store; both ranks of the second
    host die together between calls: the first host's ranks fail their next call, see the
    dead by their pulses standing still (a pid says nothing across hosts), shrink to
    themselves and go on (tests/mpi/shrink.py host), within 2 s of the deaths."""
    codes, seconds = _survivors_on_hosts(hosts, tmp_path, str(tmp_path / "store"), "host")
    assert codes == [0, 0, -9, -9]
    print("death to the first call on the shrunk communicator:", seconds, "s")
    assert max(seconds) < 2


def test_survivors_of_a_host_cut_off_shrink_and_go_on(hosts, tmp_path):
    """As the lost host, but the second host's network is cut with its ranks alive, the
    store a TCPStore on the first host: the survivors' gloo call ends when the cut-off
    ranks' pulses have stood still (not at the timeout), they shrink and go on; the
    cut-off ranks fail by themselves (the store unreachable), leaving nothing."""
    codes, seconds = _survivors_on_hosts(hosts, tmp_path, "tcp://host1:29650", "cut")
    assert codes == [0, 0, 3, 3]
    print("cut to the first call on the shrunk communicator:", seconds, "s")
    assert max(seconds) < 3


def _survivors_on_hosts(hosts, tmp_path, store: str, scenario: str) -> tuple:
    """tests/mpi/shrink.py's ``scenario`` on 4 ranks, 2 per host, meeting through ``store``
    (for "cut", the second host is unplugged once its ranks are about to call): the ranks'
    exit codes, and the times of the first host's ranks, which must have shrunk to
    themselves, from the death or the cut to their first call on the shrunk communicator.
    Nothing may be left on either host."""
    script = str(Path(__file__).parent / "mpi" / "shrink.py")
    env = {**os.environ, **checkout_env(), "COMMLIB_TUNING": "off"}
    ranks = [hosts.popen_on(hosts.names[r // 2], [
        sys.executable, script, str(r), "4", store, str(tmp_path), scenario],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(4)]
    try:
        if scenario == "cut":
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"silent-{r}").exists() for r in (2, 3)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
                time.sleep(0.01)
            (tmp_path / "cut-at").write_text(repr(time.time()))
            hosts.cut("host2")
        outputs = [p.communicate(timeout=90)[0] for p in ranks]
        left = hosts.leftovers()
    finally:
        hosts.kill_strays()
        hosts.cut("host2", off=False)
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))
    found = re.findall(r"SURVIVOR rank (\d) failed at step 3, shrank in 1 attempt\(s\) to "
                       r"ranks \[0, 1\]; first call after the death ([\d.]+) s", reports)
    assert [r for r, _ in found] == ["0", "1"], (reports, outputs)
    assert not any(left.values()), left
    return [p.returncode for p in ranks], [float(s) for _, s in found]


def test_torchrun_across_nodes(hosts):
    """torchrun --nnodes 2 --nproc-per-node 2: the backend's groups join the nodes over TCP
    (net) and share memory inside each (every collective against gloo, subgroups, a 2-D
    mesh); uneven subgroups run on net alone. Then DDP and FSDP2 at 2 nodes x 1."""
    run_checked(4, "tests/mpi/torch_collectives.py", launch=torchrun_on_hosts(hosts, 2, 2),
                timeout=400)
    run_checked(2, "tests/mpi/torch_train.py", launch=torchrun_on_hosts(hosts, 2, 1),
                timeout=300)


def test_collective_matrix_under_torchrun_across_nodes(hosts):
    """commlib.init() under torchrun on 2 nodes x 2 with COMMLIB_CROSS=gloo: every
    collective, dtype, op and algorithm (gloo's own across all four, and hier: shared
    memory, then gloo), at the small counts (the mpiexec layouts and the backend's test
    above cross the hosts over net)."""
    run_checked(4, "tests/mpi/matrix.py", "numpy", "narrow", env={"COMMLIB_CROSS": "gloo"},
                launch=torchrun_on_hosts(hosts, 2, 2), timeout=400)


def test_hosts_come_and_go_leaving_nothing():
    """Bring two hosts up, leave a process and a /dev/shm file on one, tear down: every
    holder and process is gone, and this machine has no new interface."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    with NamespaceHosts(2) as h:
        pids = list(h.pids.values()) + [h.switch]
        stray = h.popen_on("host2", ["sh", "-c", "touch /dev/shm/stray; exec sleep 600"],
                           stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while "stray" not in h.shm_files()["host2"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.leftovers(grace=0)["host2"], "the stray process and file are not seen"
        assert h.shm_files()["host1"] == [], "a host sees another host's /dev/shm"
    stray.wait(timeout=10)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a host outlived teardown"
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == links


def test_benchmark_across_hosts():
    """commlib-bench compare --hosts 2 --per-host 2: the cross-host comparison anyone can
    rerun, every implementation's result checked."""
    code, out = run_command([sys.executable, "-m", "commlib_bench", "compare", "all_reduce",
                             "all_to_all", "--hosts", "2", "--per-host", "2", "-b", "64K",
                             "-e", "64K", "--reps", "1", "--plot", ""], timeout=120)
    assert code == 0, out[-3000:]
    assert "4 ranks" in out and "FAILED" not in out and "commlib:hier" in out, out[-3000:]
