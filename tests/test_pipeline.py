"""Pipeline parallelism: the schedules in the simulator (one process, no MPI), and the runtime
under mpiexec at pp 2 and 4 (and pp x dp, pp x tp at 4 ranks) training like one process."""
import pytest

from mpirun import run_checked, sizes
from commlib_strategies.pipeline_schedules import (COMPUTE, SCHEDULES, Action, DeadlockError,
                                                   schedule, simulate)

GRID = [(p, m) for p in range(1, 9) for m in (1, 2, 3, 4, 5, 7, 8, 12, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_idle_for_p_minus_1_over_m_plus_p_minus_1(name):
    for p, m in GRID:
        for costs in ({"F": 1, "B": 2}, {"F": 1, "B": 1}, {"F": 0.5, "B": 1.5}):
            sim = simulate(schedule(name, p, m), costs)
            want = (p - 1) / (m + p - 1)
            assert sim.bubble == pytest.approx(want, abs=1e-12), (p, m, costs)
            assert all(i == pytest.approx(want, abs=1e-12) for i in sim.idle)
            total = costs["F"] + costs["B"]
            assert sim.makespan == pytest.approx((m + p - 1) * total)


def test_memory_gpipe_holds_every_microbatch_1f1b_at_most_p_minus_s():
    for p, m in GRID:
        assert simulate(schedule("gpipe", p, m)).peak_in_flight == [m] * p
        assert simulate(schedule("1f1b", p, m)).peak_in_flight == \
            [min(p - s, m) for s in range(p)]


def test_zero_bubble_h1_below_1f1b():
    """With F = I = W (B = I + W), ZB-H1's step is 3m + p - 1 once m >= p: each stage idles
    p - 1 units, a third of 1F1B's 3(p - 1), in the same peak memory as 1F1B's first stage."""
    for p, m in GRID:
        zb, one = simulate(schedule("zb-h1", p, m)), simulate(schedule("1f1b", p, m))
        if p > 1:
            assert zb.bubble < one.bubble, (p, m)
        assert max(zb.peak_in_flight) == max(one.peak_in_flight) == min(p, m)
        if m >= p:
            assert zb.makespan == 3 * m + p - 1
            assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    # unequal halves still gain: the bubble is (p - 1)(F + I - W) per stage, not (p - 1)(F + B)
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        zb = simulate(schedule("zb-h1", p, m), {"F": 1, "I": 1.2, "W": 0.8})
        one = simulate(schedule("1f1b", p, m), {"F": 1, "B": 2})
        assert zb.bubble < one.bubble


def test_interleaved_shrinks_the_bubble_v_times():
    for p, m in GRID:
        if m % p:
            continue
        for v in (2, 3, 4):
            sim = simulate(schedule("interleaved-1f1b", p, m, v), {"F": 1 / v, "B": 2 / v})
            assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


def test_every_schedule_is_complete_and_its_messages_match():
    for name in SCHEDULES:
        v = 2 if name == "interleaved-1f1b" else 1
        for p, m in [(2, 4), (3, 6), (4, 8)]:
            stages = schedule(name, p, m, v)
            sends = {(a.kind[-1], a.microbatch, a.chunk * p + a.stage + (1 if a.kind == "SEND_F"
                                                                         else -1))
                     for actions in stages for a in actions if a.kind.startswith("SEND")}
            recvs = {(a.kind[-1], a.microbatch, a.chunk * p + a.stage)
                     for actions in stages for a in actions if a.kind.startswith("RECV")}
            assert sends == recvs and len(sends) == 2 * m * (p * v - 1)
            for actions in stages:
                kinds = {a.kind for a in actions if a.kind in COMPUTE}
                assert kinds == ({"F", "I", "W"} if name == "zb-h1" else {"F", "B"})


def test_chart():
    chart = simulate(schedule("zb-h1", 2, 2)).chart()
    assert chart.splitlines() == ["stage 0: F0 F1  . I0 W0 I1 W1",
                                  "stage 1:  . F0 I0 F1 I1 W0 W1"]


def test_deadlock_is_named():
    stages = schedule("1f1b", 2, 2)
    # stage 1 waits for its backward input before it has forwarded anything: a cycle
    stages[0] = [a for a in stages[0] if a.kind.endswith("_B") or a.kind == "B"] + \
        [a for a in stages[0] if not (a.kind.endswith("_B") or a.kind == "B")]
    with pytest.raises(DeadlockError, match=r"stage 0 at RECV_B0@0 waits for SEND_B0@1; "
                                            r"stage 1 at RECV_F0@1 waits for SEND_F0@0"):
        simulate(stages)


def test_malformed_schedules():
    good = schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"stage 0 .*: missing B1@0"):
        simulate([good[0][:-1], good[1]])
    with pytest.raises(ValueError, match=r"unexpected or repeated F0@1"):
        simulate([good[0], good[1] + [Action(1, "F", 0)]])
    with pytest.raises(ValueError, match=r"stage 0's list holds F0@1"):
        simulate([[Action(1, "F", 0)], good[1]])
    with pytest.raises(ValueError, match="not an Action"):
        simulate([[Action(0, "X", 0)]])
    with pytest.raises(ValueError, match="cost for unknown action kind 'Z'"):
        simulate(good, {"Z": 1})


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="stages must be a positive int"):
        schedule("1f1b", 0, 2)
    with pytest.raises(ValueError, match="microbatches divisible by stages"):
        schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="needs virtual >= 2"):
        schedule("interleaved-1f1b", 4, 8)
    with pytest.raises(ValueError, match="use interleaved-1f1b for virtual stages"):
        schedule("zb-h1", 4, 8, 2)


@pytest.mark.parametrize("n", sizes(2, 4, long=(4,)))
def test_pipeline_trains_like_one_process(n):
    pytest.importorskip("torch")
    out = run_checked(n, "tests/mpi/strategies_pp.py")
    assert out.count("measured idle") == len(SCHEDULES), out[-3000:]
