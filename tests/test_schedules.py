"""Every schedule of every algorithm, simulated for world sizes 1..16, and hier's runners
among ranks that are threads (no MPI)."""
import threading

import numpy as np
import pytest

from commlib import algorithms
from commlib.algorithms import COLLECTIVES, get
from commlib.transports.base import Where
from commlib.schedule import Builder, Recv, RecvReduce, Region, ScheduleError, Send, simulate

SIZES = range(1, 17)
NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def reference(collective, inputs, op="sum", root=0, splits=None) -> list:
    """What each collective must produce on every rank, from every rank's input (float64,
    exact arithmetic)."""
    n = len(inputs)
    if collective in ("all_reduce", "reduce_scatter", "reduce"):
        total = inputs[0].copy()
        for x in inputs[1:]:
            total = NUMPY_OPS[op](total, x)
        if collective == "all_reduce":
            return [total.copy() for _ in range(n)]
        if collective == "reduce":
            return [total if r == root else inputs[r].copy() for r in range(n)]
        return list(np.split(total, n))
    if collective == "all_gather":
        return [np.concatenate(inputs) for _ in range(n)]
    if collective == "broadcast":
        return [inputs[root].copy() for _ in range(n)]
    if collective == "all_to_all":
        offsets = [np.concatenate([[0], np.cumsum(s)]) for s in splits]
        return [np.concatenate([inputs[src][offsets[src][dst]:offsets[src][dst + 1]]
                                for src in range(n)]) for dst in range(n)]
    raise ValueError(f"no reference for collective {collective!r}")


def counts(size):
    return sorted({0, 1, 2, size - 1, size, size + 1, 2 * size + 3, 13, 97})


def schedule_algorithms():
    return [(c, name) for c in COLLECTIVES for name in algorithms(c)
            if get(c, name).build is not None]


def run_case(collective, name, size, count, op="sum", root=0, seed=0):
    rng = np.random.default_rng(seed)
    build = get(collective, name).build
    params, splits = {}, None
    if collective in ("broadcast", "reduce"):
        params["root"] = root
    if collective == "all_to_all":
        splits = rng.integers(0, count + 1, size=(size, size))  # splits[src][dst]
    in_counts = {"all_reduce": count, "broadcast": count, "reduce": count, "all_gather": count,
                 "reduce_scatter": size * count}
    inputs = [rng.integers(-4, 5, size=int(splits[r].sum()) if splits is not None
                           else in_counts[collective]).astype(np.float64) for r in range(size)]
    schedules, buffers = [], []
    for r in range(size):
        if collective == "all_to_all":
            params = {"input_splits": tuple(int(x) for x in splits[r]),
                      "output_splits": tuple(int(x) for x in splits[:, r])}
        schedules.append(build(size, r, count, 8, **params))
        if collective in ("all_reduce", "broadcast", "reduce"):
            buffers.append({"out": inputs[r].copy()})
        else:
            out = {"reduce_scatter": count, "all_gather": size * count,
                   "all_to_all": int(splits[:, r].sum()) if splits is not None else 0}[collective]
            buffers.append({"in": inputs[r].copy(), "out": np.full(out, np.nan)})
    simulate(schedules, buffers, op)
    expected = reference(collective, inputs, op, root, splits)
    for r in range(size):
        np.testing.assert_array_equal(buffers[r]["out"], expected[r],
                                      err_msg=f"{name} {collective} size {size} rank {r}")
        if "in" in buffers[r]:
            np.testing.assert_array_equal(buffers[r]["in"], inputs[r], err_msg="input modified")


@pytest.mark.parametrize("collective,name", schedule_algorithms())
def test_schedule_matches_reference(collective, name):
    for size in SIZES:
        for count in counts(size):
            ops = ["sum", "max"] if collective in ("all_reduce", "reduce", "reduce_scatter") \
                else ["sum"]
            roots = sorted({0, size - 1, size // 2}) if collective in ("broadcast", "reduce") \
                else [0]
            for op in ops:
                for root in roots:
                    run_case(collective, name, size, count, op, root, seed=size * 1000 + count)


def test_large_broadcast_pipelines_in_segments():
    sched = get("broadcast", "ring").build(4, 1, 1 << 20, 4, root=0)
    assert len(sched.rounds) > 8  # segments flow down the chain
    run_case("broadcast", "ring", 5, 300_000, root=3)


OFFERS = {"shm": frozenset({"shm", "mpi", "schedules"}),  # as the transports'
          "shm-one-copy": frozenset({"shm", "one_copy", "mpi", "schedules"}),
          "mpi": frozenset({"mpi", "schedules", "eager"}),
          "hosts": frozenset({"hosts", "mpi", "schedules", "eager"}),
          "gloo": frozenset({"gloo"}), "gloo-hosts": frozenset({"hosts", "gloo"})}


class _On:  # stands in for a communicator whose transport offers these
    def __init__(self, transport, mpi=True):
        self.offers = OFFERS[transport] if mpi else OFFERS[transport] - {"mpi"}


def test_registry_lists_expected_names():
    # (ordered, built from other collectives, runs wherever they do)
    assert algorithms("all_reduce") == ["direct", "eager", "gloo", "hier", "native", "one_copy",
                                        "ordered", "rhd", "ring", "tree"]
    assert algorithms("all_reduce", _On("shm")) == ["direct", "native", "ordered", "rhd", "ring",
                                                    "tree"]
    assert algorithms("all_reduce", _On("shm-one-copy")) == ["direct", "native", "one_copy",
                                                             "ordered", "rhd", "ring", "tree"]
    assert algorithms("reduce", _On("shm-one-copy")) == ["direct", "native", "ordered", "tree"]
    assert algorithms("all_reduce", _On("hosts")) == ["eager", "hier", "native", "ordered",
                                                      "rhd", "ring", "tree"]
    assert algorithms("all_reduce", _On("mpi")) == ["eager", "native", "ordered", "rhd", "ring",
                                                    "tree"]
    assert algorithms("all_reduce", _On("shm", mpi=False)) == ["direct", "ordered", "rhd",
                                                               "ring", "tree"]
    # torchrun's nodes: no schedules
    assert algorithms("all_reduce", _On("gloo")) == ["gloo", "ordered"]
    assert algorithms("all_reduce", _On("gloo-hosts")) == ["gloo", "hier", "ordered"]
    assert algorithms("all_to_all") == ["direct", "gloo", "native", "one_copy", "pairwise"]
    with pytest.raises(ValueError, match="valid: direct, gloo, native, one_copy, pairwise"):
        get("all_to_all", "ring")
    with pytest.raises(ValueError, match="needs all ranks on one host.*valid here: eager, native"):
        get("all_reduce", "direct", OFFERS["mpi"])
    with pytest.raises(ValueError, match="needs the MPI library.*valid here: direct, ordered, rhd"):
        get("all_reduce", "native", _On("shm", mpi=False).offers)
    with pytest.raises(ValueError, match="needs a transport that runs schedules.*valid here: gloo"):
        get("all_reduce", "ring", OFFERS["gloo"])


def _sched(*rounds):
    b = Builder()
    for r in rounds:
        b.round(*r)
    return b.build()


def test_simulator_detects_deadlock():
    a, b = Region("out", 0, 4), Region("out", 4, 4)
    # both ranks receive first, then send: classic deadlock
    s0 = _sched([Recv(1, a)], [Send(1, b)])
    s1 = _sched([Recv(0, a)], [Send(0, b)])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([s0, s1], [{"out": np.zeros(8)}, {"out": np.zeros(8)}])


def test_simulator_detects_unmatched_transfer():
    s0 = _sched([Send(1, Region("out", 0, 4))])
    s1 = _sched()
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([s0, s1], [{"out": np.zeros(4)}, {"out": np.zeros(4)}])


def test_simulator_detects_count_mismatch_and_races():
    s0 = _sched([Send(1, Region("out", 0, 4))])
    s1 = _sched([Recv(0, Region("out", 0, 3))])
    with pytest.raises(ScheduleError, match="expects 3"):
        simulate([s0, s1], [{"out": np.zeros(4)}, {"out": np.zeros(4)}])
    racy = _sched([Send(1, Region("out", 0, 4)), RecvReduce(1, Region("out", 2, 4),
                                                            Region("out", 2, 4))])
    with pytest.raises(ScheduleError, match="races"):
        simulate([racy, racy], [{"out": np.zeros(8)}, {"out": np.zeros(8)}])


def test_simulator_detects_out_of_bounds():
    s0 = _sched([Send(1, Region("out", 2, 4))])
    with pytest.raises(ScheduleError, match="outside"):
        simulate([s0, _sched()], [{"out": np.zeros(4)}, {"out": np.zeros(4)}])


def test_shm_plans_defer_only_independent_copies():
    """The shared-memory executor may run a copy late only when no transfer of its round
    touches it: the own part of a pairwise all_to_all, not the own block a ring all_gather
    sends on, nor anything in/out may alias in an in-place form."""
    from commlib.transports.plans import _deferrable

    def flags(collective, name, aliased, **params):
        sched = get(collective, name).build(3, 0, 12, 4, **params)
        return [_deferrable(c, rnd, aliased) for rnd in sched.rounds for c in rnd.copies]

    splits = {"input_splits": (4, 4, 4), "output_splits": (4, 4, 4)}
    assert flags("all_to_all", "pairwise", False, **splits) == [True]
    assert flags("all_gather", "ring", True) == [False]
    assert flags("all_to_all", "pairwise", True, **splits) == [False]  # if in/out could alias



class _ThreadGroup:
    """A group of ranks that are threads of this process (HostLayout's world and hier's
    stages): they meet at a barrier, and its collectives (broadcast, all_gather) copy
    between their numpy buffers."""

    def __init__(self, shared: dict, members: tuple, rank: int):
        self.shared, self.members, self.me = shared, members, rank
        self.rank, self.size, self.calls = members.index(rank), len(members), 0
        self.where = Where()

    def allgather(self, value) -> list:
        self.calls += 1
        key = (self.members, self.calls)
        with self.shared["lock"]:
            if self.members not in self.shared:
                self.shared[self.members] = threading.Barrier(self.size)
            barrier = self.shared[self.members]
            self.shared[key, self.me] = value
        barrier.wait()
        got = [self.shared[key, r] for r in self.members]
        barrier.wait()
        return got

    def split(self, color, key) -> "_ThreadGroup":
        everyone = sorted(self.allgather((key, color, self.me)))
        return _ThreadGroup(self.shared, tuple(r for _, c, r in everyone if c == color),
                            self.me)

    def execute(self, call) -> None:
        views = self.allgather((call.out.bytes, call.inp and call.inp.bytes))
        if call.collective == "broadcast" and self.rank != call.root:
            call.out.bytes[:] = views[call.root][0]
        elif call.collective == "all_gather":
            call.out.bytes[:] = np.concatenate([inp.copy() for _, inp in views])
        self.allgather(None)  # no rank writes before every one has read


@pytest.mark.parametrize("hosts", [[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1, 1, 0]], ids=str)
def test_hier_broadcast_across_hosts_in_any_rank_order(hosts):
    """hier's broadcast (shards across, then an all-gather on each other host), from every
    root and at counts that leave a remainder, where a host's place in the cross groups
    differs between them (hosts [0, 1, 1, 0]: local rank 1's group lists host 1 first)."""
    from commlib.algorithms import hier
    from commlib.buffers import as_buffer
    from commlib.call import Call
    from commlib.transports.hosts import HostLayout
    n, shared, failures = len(hosts), {"lock": threading.Lock()}, []

    class Layout(HostLayout):
        name, checks_calls = "hosts", True

    def run(rank):
        try:
            world = _ThreadGroup(shared, tuple(range(n)), rank)
            t = Layout()
            t.rank = rank
            t.join_hosts(world, hosts[rank], lambda g: g, lambda g: g, "mpi")
            for count in (0, 1, 5, 64):
                for root in range(n):
                    data = np.arange(count, dtype=np.float32) + (100 * root if rank == root
                                                                   else -1)
                    buf = as_buffer(data)
                    hier.broadcast(t, Call("broadcast", buf, None, count, buf.dtype, None,
                                           root, None, None))
                    expected = np.arange(count, dtype=np.float32) + 100 * root
                    assert np.array_equal(data, expected), (rank, root, count, data)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            failures.append(e)
            for barrier in [v for v in shared.values() if isinstance(v, threading.Barrier)]:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not failures, failures[0]
