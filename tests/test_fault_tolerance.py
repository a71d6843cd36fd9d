"""Going on without a dead rank: Communicator.shrink (survivors of a killed rank agree on
themselves and go on, DataParallel with them: tests/mpi/shrink.py), with nothing left in
/dev/shm; torchft's Fault Tolerant DDP on commlib's reconfigurable group losing a replica
and getting it back (tests/mpi/torchft_ddp.py); torchrun restarting commlib-train."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import checkout_env
from test_mpi import _segments

SCENARIOS = [  # (scenario, ranks, the dead): tests/mpi/shrink.py
    ("dp", 3, {2}),
    ("between", 4, {0, 1}),
    pytest.param("inside", 3, {2}, marks=pytest.mark.long),
]


def _store_ranks(scenario: str, n: int, dead: set, tmp_path, hosts=None) -> str:
    """Run tests/mpi/shrink.py's ``scenario`` on ``n`` ranks that meet through a file store
    (on ``hosts[r]``, their COMMLIB_HOSTID, where given); those in ``dead`` must end
    SIGKILLed (one stopped is killed once the others end), the others with 0. Their
    reports, rank by rank."""
    pytest.importorskip("torch")
    script = str(Path(__file__).parent / "mpi" / "shrink.py")
    env = {**os.environ, **checkout_env(), "COMMLIB_TUNING": "off"}
    ranks = [subprocess.Popen([sys.executable, script, str(r), str(n), str(tmp_path / "store"),
                               str(tmp_path), scenario],
                              env={**env, "COMMLIB_HOSTID": hosts[r]} if hosts else env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    outputs = [""] * n
    try:
        for r in sorted(range(n), key=lambda r: r in dead):  # the survivors first
            if r in dead:
                ranks[r].kill()
            outputs[r] = ranks[r].communicate(timeout=90)[0]
    finally:
        for p in ranks:
            p.kill()
    for r in range(n):
        expected = -signal.SIGKILL if r in dead else 0
        assert ranks[r].returncode == expected, outputs[r][-3000:]
    return "".join(f.read_text() for f in sorted(tmp_path.glob("rank-*.txt")))


@pytest.mark.parametrize("scenario,n,dead", SCENARIOS, ids=["dp", "between", "inside"])
def test_survivors_shrink_and_go_on(scenario, n, dead, tmp_path):
    before = _segments()
    reports = _store_ranks(scenario, n, dead, tmp_path)
    alive = [r for r in range(n) if r not in dead]
    found = re.findall(r"SURVIVOR rank (\d) failed at step (\d), shrank in (\d) attempt\(s\) "
                       r"to ranks \[(.*)\]; first call after the death ([\d.]+) s", reports)
    assert sorted(int(r) for r, *_ in found) == alive, reports
    for _, step, attempts, members, seconds in found:
        assert step == "3" and [int(m) for m in members.split(", ")] == alive, reports
        assert int(attempts) == (2 if scenario == "between" else 1)
        assert float(seconds) < 10, reports
    assert _segments() <= before, "shared memory left behind"


def test_a_silent_host_is_left_behind_by_its_pulse(tmp_path):
    """3 ranks on two hosts as commlib sees them (COMMLIB_HOSTID: gloo joins them); the
    second host's rank stops (SIGSTOP) before a call, alive but silent as a host cut off
    from the network: the survivors' gloo call fails once its pulse stood still (1 s), not
    at the timeout (20 s); they shrink to themselves, on shared memory, and go on
    (tests/mpi/shrink.py silent)."""
    before = _segments()
    reports = _store_ranks("silent", 3, {2}, tmp_path, hosts=["a", "a", "b"])
    found = re.findall(r"SURVIVOR rank (\d) failed at step 3, shrank in 1 attempt\(s\) to "
                       r"ranks \[0, 1\]; first call after the death ([\d.]+) s", reports)
    assert [r for r, _ in found] == ["0", "1"], reports
    print("silence to the first call on the shrunk communicator:", [s for _, s in found], "s")
    assert max(float(s) for _, s in found) < 5, reports  # (1 s of silence, then a slice)
    assert _segments() <= before, "shared memory left behind"


def test_abort_ends_a_call_in_flight(tmp_path):
    """Communicator.abort from another thread (a watchdog) while this rank waits in a call
    for a live peer: the call fails at once, not at its timeout (20 s), and its peers' calls
    fail too, naming the abort (tests/mpi/shrink.py abort)."""
    before = _segments()
    reports = _store_ranks("abort", 3, set(), tmp_path)
    found = dict(re.findall(r"ABORTED rank (\d) after ([\d.]+) s", reports))
    assert sorted(found) == ["0", "1", "2"], reports
    assert float(found["0"]) < 2, reports  # (0.3 s, and a nap of at most 2 ms after)
    assert _segments() <= before, "shared memory left behind"


@pytest.mark.long
def test_torchft_ddp_loses_a_replica_and_gets_it_back(tmp_path):
    """Two replica groups (a process each) under torchft's lighthouse, their gradients
    all-reduced by commlib (commlib/torch/ft.py). Replica 1 is killed at step 4: replica 0's
    step 4 fails (commlib sees the death) and is not committed, the only step lost; replica
    1 restarted heals from replica 0 and both end at step 10 with the same parameters."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer
    before = _segments()
    script = str(Path(__file__).parent / "mpi" / "torchft_ddp.py")
    env = {**os.environ, **checkout_env(), "COMMLIB_TUNING": "off", "RUST_LOG": "warn"}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200)

    def replica(r: int, die_at: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, script, lighthouse.address(), str(r), "10",
                                 str(die_at), str(tmp_path / f"replica{r}.json")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, doomed = replica(0, -1), replica(1, 4)
    try:
        out = doomed.communicate(timeout=120)[0]
        assert doomed.returncode == -signal.SIGKILL, out[-3000:]
        again = replica(1, -1)
        outputs = [p.communicate(timeout=120)[0] for p in (first, again)]
        assert [first.returncode, again.returncode] == [0, 0], outputs
    finally:
        for p in (first, doomed):
            p.kill()
        lighthouse.shutdown()
    survivor, healed = (json.loads((tmp_path / f"replica{r}.json").read_text())
                        for r in (0, 1))
    assert survivor["step"] == healed["step"] == 10
    assert survivor["uncommitted"] == [4], survivor  # the step in flight, no other
    assert 2 in survivor["quorums"] and 2 in healed["quorums"]
    assert survivor["commlib_ops"] > 0 and healed["commlib_ops"] > 0
    assert survivor["params"] == healed["params"]
    assert _segments() <= before, "shared memory left behind"


@pytest.mark.long
def test_torchrun_restarts_a_training_run_that_lost_a_rank(tmp_path):
    """torchrun --max-restarts 1: a rank of commlib-train killed mid-run ends the attempt,
    torchrun starts the workers again, and --resume takes the run up from its newest
    checkpoint: the steps after it are the same bits as an uninterrupted run's, and the
    first attempt leaves nothing behind (its keys in the agent's store kept apart)."""
    pytest.importorskip("torch")
    from training import SMALL
    before = _segments()
    env = {**os.environ, **checkout_env(), "COMMLIB_TUNING": "off", "OMP_NUM_THREADS": "1"}

    def train(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "--max-restarts", "1", "-m", "commlib_strategies.train", "--zero", "3",
             *SMALL, "--steps", "60", "--save-dir", str(tmp_path / name), "--save-every", "20",
             "--resume", "--step-log", str(tmp_path / f"{name}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    whole, cut = train("whole"), train("cut")
    try:
        first = tmp_path / "cut" / "step-00000020" / "manifest.json"
        while not first.exists():
            assert cut.poll() is None, cut.communicate()[0][-3000:]
            time.sleep(0.005)
        workers = subprocess.run(["pgrep", "-P", str(cut.pid), "-f", "commlib_strategies.train"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[1]), signal.SIGKILL)
        outputs = [p.communicate(timeout=180)[0] for p in (whole, cut)]
    finally:
        for p in (whole, cut):
            p.kill()
    assert [whole.returncode, cut.returncode] == [0, 0], [o[-3000:] for o in outputs]
    resumed = re.search(r"# resumed at step (\d+)", outputs[1])
    assert resumed and int(resumed.group(1)) in (20, 40), outputs[1][-3000:]
    steps = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("whole", "cut")]
    losses = [[r["loss"] for r in log] for log in steps]
    assert losses[1] == losses[0][int(resumed.group(1)):]  # exactly
    assert _segments() <= before, "the first attempt left shared memory behind"


def test_zero_regroup_keeps_what_survives_and_refuses_stage_3():
    """One rank regrouped onto itself keeps every weight and every optimizer state (the
    resharding's bookkeeping: the 3-rank case is tests/mpi/shrink.py dp); stage 3, whose
    dead rank took parameter shards with it, refuses, pointing to the checkpoint."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import commlib
    from commlib_strategies.zero import ZeRO
    world = commlib.Communicator.from_store(dist.HashStore(), 0, 1)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    stage3 = ZeRO(model(), world, 3, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(commlib.CommError, match="stage 3 .* last checkpoint"):
        stage3.regroup(world)
    for stage in (1, 2):
        zero = ZeRO(model(), world, stage, lambda ps: torch.optim.Adam(ps, lr=0.1))
        zero(torch.randn(4, 3)).sum().backward()
        zero.step()
        weights = [p.clone() for p in zero.module.parameters()]
        state = {k: v.clone() for k, v in zero.optimizer.state[zero.master].items()}
        zero.regroup(world.dup())
        assert all(torch.equal(a, b) for a, b in zip(weights, zero.module.parameters()))
        assert all(torch.equal(v, zero.optimizer.state[zero.master][k]) for k, v in state.items())
        zero(torch.randn(4, 3)).sum().backward()  # and it trains on
        zero.step()
    world.free()
