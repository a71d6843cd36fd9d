"""Algorithm choice: explicit names, the environment override, and the cost model."""
import math

import pytest

from commlib import algorithms
from commlib.algorithms import entries, get
from commlib.algorithms.pages import by_pages
from commlib.select import CostModel, choose
from commlib.transports.base import Where

DEFAULTS = CostModel()  # not the machine's tuning file: these tests must not depend on it


def test_explicit_and_environment(monkeypatch):
    assert choose("all_reduce", "tree", 4, 1 << 20).name == "tree"
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "ring")
    assert choose("all_reduce", None, 4, 8).name == "ring"
    assert choose("all_reduce", "rhd", 4, 8).name == "rhd"  # the argument beats the environment
    monkeypatch.setenv("COMMLIB_ALGO_ALL_REDUCE", "fastest")
    with pytest.raises(ValueError, match="unknown algorithm 'fastest' for all_reduce; valid: "
                                         "native, ordered, rhd, ring, tree"):  # plain MPI comm
        choose("all_reduce", None, 4, 8)


def test_user_ops_and_deterministic_mode_narrow_the_choice():
    gloo = frozenset({"gloo"})
    assert choose("all_reduce", None, 4, 1 << 20, transport="gloo", offers=gloo).name == "gloo"
    assert choose("all_reduce", None, 4, 1 << 20, transport="gloo", offers=gloo,
                  user_op=True).name == "ordered"
    with pytest.raises(ValueError, match="'gloo' cannot run this call: it does not run "
                                         "user-defined"):
        choose("all_reduce", "gloo", 4, 8, offers=gloo, user_op=True)
    shm = frozenset({"shm", "schedules", "one_copy", "mpi"})
    for nbytes in (8, 1 << 16, 1 << 24):
        for collective in ("all_reduce", "reduce_scatter", "reduce"):
            picked = choose(collective, None, 4, nbytes, transport="shm", offers=shm,
                            deterministic=True, model=DEFAULTS)
            assert picked.rank_order, (collective, nbytes, picked.name)
    with pytest.raises(ValueError, match="deterministic mode needs an algorithm that reduces "
                                         "in rank order"):
        choose("all_reduce", "ring", 4, 8, deterministic=True)
    assert choose("all_gather", "ring", 4, 8, deterministic=True).name == "ring"


def test_model_prefers_latency_small_and_bandwidth_large():
    # MPI's own collective wins tiny messages (less per-round overhead); the schedules win
    # large all_reduce, where they measured faster than MPICH (see
    # commlib_bench/all_reduce_sweep.py)
    assert choose("all_reduce", None, 2, 8, DEFAULTS).name == "native"
    assert choose("all_reduce", None, 2, 64 << 20, DEFAULTS).name in ("ring", "rhd")
    assert choose("all_reduce", None, 3, 64 << 20, DEFAULTS).name == "ring"  # rhd folds
    # a large reduce: a tree, or ordered's reduce-scatter then gather (Rabenseifner's
    # bytes: less per rank than the tree's; they measured alike at 4 MiB, 4 ranks)
    assert choose("reduce", None, 4, 8 << 20, DEFAULTS).name in ("tree", "ordered")


def test_every_algorithm_has_a_cost():
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                       "reduce"):
        for name in algorithms(collective):
            for n in (1, 2, 5, 16):
                if name == "hier" and n == 1:  # needs two hosts at least
                    continue
                nbytes = 256 if name == "eager" else 1 << 16  # (eager: small calls only)
                cost = DEFAULTS.predict(collective, name, n, nbytes,
                                        "shm" if name in ("direct", "one_copy") else "mpi", 1)
                assert 0 < cost < math.inf, (collective, name, n)
    assert DEFAULTS.predict("all_reduce", "eager", 2, 1 << 21) == math.inf  # beyond its limit


def test_tuning_file_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("COMMLIB_TUNING", str(path))
    assert CostModel.load() == CostModel()  # no file: defaults
    tuned = CostModel(alpha=1e-5, beta=2e-10, gamma=3e-11, alpha_native=5e-6,
                      native_per_byte=tuple(sorted({**dict(DEFAULTS.native_per_byte),
                                                    "all_reduce": 1e-10}.items())))
    assert tuned.save() == path
    assert CostModel.load() == tuned
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibrate"):
        CostModel.load()


def test_measured_table_choice():
    """The fastest at a size, interpolated in log size; a choice that may not depend on the
    size (all_to_all) takes the least geometric-mean loss over the sizes; one measured on
    both kinds of memory whose fastest differ is the pair, by the call's memory; refused
    sizes and missing entries are passed over."""
    from commlib.tuning import Table
    table = Table({"all_to_all": {"a": [[1 << 16, 1.0], [1 << 20, 10.0], [1 << 24, 100.0]],
                                  "b": [[1 << 16, 2.5], [1 << 20, 9.0], [1 << 24, 95.0]]},
                   "all_reduce": {"eager": [[256, 1.0], [4096, 2.0]],
                                  "ring": [[256, 3.0], [4096, 4.0], [1 << 20, 40.0]]}})
    assert table.fastest("all_to_all", 1 << 16, ["a", "b"]) == "a"
    assert table.fastest("all_to_all", 1 << 20, ["a", "b"]) == "b"
    assert table.fastest("all_to_all", None, ["a", "b"]) == "a"  # b loses 2.5x at 64 KiB
    assert table.fastest("all_to_all", None, ["c"]) is None
    offers = frozenset({"mpi", "schedules", "eager"})
    assert choose("all_to_all", None, 2, 10, offers=offers, measured=table).name in (
        "native", "pairwise")  # neither measured: the cost model
    assert choose("all_reduce", None, 2, 1024, offers=offers, measured=table).name == "eager"
    # beyond eager's limit it is never chosen, however its time extrapolates
    assert choose("all_reduce", None, 2, 1 << 21, offers=offers, measured=table).name == "ring"
    # measured on huge pages too: where the fastest there differs, the call's memory
    # decides (algorithms/pages.py), for a size-free choice as for a sized one
    table.on_huge_pages = {"all_to_all": {"a": [[1 << 16, 1.0], [1 << 20, 40.0]],
                                          "b": [[1 << 16, 1.0], [1 << 20, 10.0]]}}
    assert table.fastest("all_to_all", None, ["a", "b"], memory="huge") == "b"
    assert table.fastest("all_to_all", 1 << 16, ["a", "b"], memory="huge") == "a"  # (a tie)
    assert table.fastest("all_to_all", None, ["a", "c"], memory="huge") == "a"
    shm = frozenset({"shm", "schedules", "one_copy"})
    mb4 = 4 << 20
    table.times["broadcast"] = {"tree": [[mb4, 40.0]], "one_copy": [[mb4, 44.0]]}
    assert choose("broadcast", None, 2, mb4, offers=shm, measured=table).name == "tree"
    table.on_huge_pages["broadcast"] = {"tree": [[mb4, 40.0]], "one_copy": [[mb4, 27.0]]}
    both = choose("broadcast", None, 2, mb4, offers=shm, measured=table)
    # one_copy's own meeting decides: it stages by tree where it cannot read in place
    assert (both.name, both.otherwise.name) == ("one_copy", "tree") and both.agrees
    table.base_pages_in_place = ["broadcast"]  # (one_copy would read 4 KiB pages too)
    both = choose("broadcast", None, 2, mb4, offers=shm, measured=table)
    assert both.name == "pages" and both.run is not None and both.agrees
    table.base_pages_in_place = []
    tree, one_copy, direct = (entries("broadcast")[a] for a in ("tree", "one_copy", "direct"))
    assert by_pages(one_copy, direct) == one_copy  # (it stages as direct does anyway)
    assert by_pages(tree, one_copy).name == "pages"  # (a flag decides)
    assert choose("broadcast", "tree", 2, mb4, offers=shm, measured=table).name == "tree"
    # not where a buffer cannot fill a huge page; a gain under pages.WORTH pays only where
    # one_copy's meeting decides (a flag costs more)
    assert choose("broadcast", None, 2, 1 << 20, offers=shm, measured=table).name == "tree"
    table.on_huge_pages["broadcast"]["one_copy"] = [[mb4, 35.0]]  # 1.14x
    assert choose("broadcast", None, 2, mb4, offers=shm, measured=table).otherwise.name == "tree"
    table.base_pages_in_place = ["broadcast"]
    assert choose("broadcast", None, 2, mb4, offers=shm, measured=table).name == "tree"
    table.on_huge_pages["broadcast"]["one_copy"] = [[mb4, 41.0]]  # (a loss)
    table.base_pages_in_place = []
    assert choose("broadcast", None, 2, mb4, offers=shm, measured=table).name == "tree"



def test_auto_weighs_one_copy_in_regions_once_there_are_some():
    """Where one_copy ran faster in regions than the 4 KiB pages' choice, a communicator
    that has handed out regions routes calls through it (reading in place only there,
    else staging by that choice); not before, not where it ran slower, and not past what
    one_copy cannot stage by (MPI's own) or where the choice is one_copy already."""
    from commlib.tuning import Table
    K, shm = 1 << 10, frozenset({"shm", "schedules", "one_copy", "mpi"})
    table = Table({"all_gather": {"ring": [[64 * K, 10.0], [2048 * K, 100.0]],
                                  "one_copy": [[64 * K, 20.0], [2048 * K, 200.0]]}},
                  {}, in_regions={"all_gather": {"one_copy": [[64 * K, 4.0],
                                                              [2048 * K, 120.0]]}})

    def chosen(nbytes, regions=True):
        return choose("all_gather", None, 2, nbytes, offers=shm, measured=table,
                      regions=regions)
    assert chosen(64 * K, regions=False).name == "ring"
    routed = chosen(64 * K)
    assert (routed.name, routed.otherwise.name, routed.only_regions) == \
        ("one_copy", "ring", True) and routed.agrees
    assert chosen(2048 * K).name == "ring"  # (one_copy slower in regions there)
    assert choose("all_gather", "one_copy", 2, 64 * K, offers=shm, measured=table,
                  regions=True).only_regions is False  # (asked for: reads where it can)
    table.times["all_gather"]["direct"] = [[64 * K, 5.0], [2048 * K, 50.0]]
    routed = chosen(64 * K)
    assert (routed.name, routed.otherwise, routed.only_regions) == ("one_copy", None, True)
    table.times["all_gather"]["native"] = [[64 * K, 1.0], [2048 * K, 10.0]]
    assert chosen(64 * K).name == "native"  # (one_copy cannot stage by MPI's own)
    table.times["all_gather"]["one_copy"] = [[64 * K, 0.5], [2048 * K, 5.0]]
    assert chosen(64 * K) == entries("all_gather")["one_copy"]


def test_tuning_times_again_between_differing_winners_and_outliers():
    """Neighbouring sizes with different winners further than 2x apart get a size between
    them (log middle), until brackets span 2x; a winner unlike both neighbours is timed
    again first, once; all_to_all (one choice for all sizes) and eager past its payload
    (never chosen there) are passed over."""
    from commlib.tuning import Table, to_time_again
    K = 1 << 10
    table = Table({"all_reduce": {"ring": [[4 * K, 2.0], [256 * K, 4.0], [2048 * K, 8.0]],
                                  "rhd": [[4 * K, 1.0], [256 * K, 5.0], [2048 * K, 9.0]],
                                  "eager": [[4 * K, 0.1]]},  # (refused from 1 MiB: passed over)
                   "all_gather": {"ring": [[4 * K, 1.0], [16 * K, 3.0], [64 * K, 1.0]],
                                  "rhd": [[4 * K, 2.0], [16 * K, 1.0], [64 * K, 2.0]]},
                   "all_to_all": {"a": [[4 * K, 1.0], [2048 * K, 3.0]],
                                  "b": [[4 * K, 2.0], [2048 * K, 1.0]]}})
    retimed = set()
    # rhd wins all_gather at 16 KiB alone: timed again before any bracket is cut
    assert to_time_again(table, 2, None, retimed) == {16 * K: ["all_gather"]}
    assert retimed == {("all_gather", 16 * K)}
    # then: eager wins 4 KiB, ring 256 KiB and 2 MiB; all_gather's brackets span 4x
    todo = to_time_again(table, 2, None, retimed)
    assert todo == {32 * K: ["all_reduce", "all_gather"], 8 * K: ["all_gather"]}, todo
    table.put([("base", "all_reduce", name, 32 * K) for name in ("ring", "rhd", "eager")],
              [3.0, 2.0, 0.2])  # eager wins at 32 KiB, so at 256 KiB (extrapolated) too
    table.times["all_gather"] = {"ring": [[4 * K, 1.0], [64 * K, 2.0]],
                                 "rhd": [[4 * K, 2.0], [64 * K, 2.5]]}
    assert to_time_again(table, 2, None, retimed) == {1024 * K: ["all_reduce"]}
    table.put([("base", "all_reduce", name, 1024 * K) for name in ("ring", "rhd")], [6.0, 7.0])
    assert to_time_again(table, 2, None, retimed) == {512 * K: ["all_reduce"]}
    table.put([("base", "all_reduce", name, 512 * K) for name in ("ring", "rhd", "eager")],
              [3.5, 4.5, 1.0])
    assert to_time_again(table, 2, None, retimed) == {}  # eager to 512 KiB, ring from 1 MiB
    # a re-timed point keeps the lesser time
    table.put([("base", "all_reduce", "ring", 1024 * K)], [5.0], keep_least=True)
    table.put([("base", "all_reduce", "rhd", 1024 * K)], [9.0], keep_least=True)
    assert table.at(("base", "all_reduce", "ring", 1024 * K)) == 5.0
    assert table.at(("base", "all_reduce", "rhd", 1024 * K)) == 7.0
    assert [b for b, _ in table.times["all_reduce"]["ring"]] == sorted(
        b for b, _ in table.times["all_reduce"]["ring"])


def test_tuning_measures_again_where_the_reference_met_a_spell():
    from commlib.tuning import Table, spells
    K = 1 << 10
    table = Table({"all_reduce": {"native": [[4 * K, 1.0], [64 * K, 4.0], [2048 * K, 50.0]],
                                  "ring": [[4 * K, 3.0], [64 * K, 5.0], [2048 * K, 40.0]]},
                   "broadcast": {"native": [[4 * K, 1.0], [64 * K, 2.0], [2048 * K, 30.0]]}})
    again = Table({"all_reduce": {"native": [[4 * K, 1.1], [64 * K, 2.0], [2048 * K, 25.0]]},
                   "broadcast": {"native": [[4 * K, 0.9], [64 * K, 1.9], [2048 * K, 14.0]]}})
    # 64 KiB: 2x and 1.05x (geometric mean 1.45: kept); 2 MiB 2x and 2.1x: measured again
    assert spells(table, again) == [2048 * K]
    again.times["all_reduce"]["native"][0][1] = 0.5  # faster then is as suspect as slower
    again.times["broadcast"]["native"][0][1] = 0.6
    assert spells(table, again) == [4 * K, 2048 * K]


def test_tuning_measures_again_where_a_contender_met_a_spell():
    """A spell that slows the staged copies and not the reference (MPI's single copy):
    each size's two fastest are timed again with the reference, and a collective whose
    winner or runner-up moved by 1.5x either way is measured again there; the reference
    alone moving is left to spells()."""
    from commlib.tuning import Table, to_check, upsets
    K = 1 << 10
    table = Table({"broadcast": {"native": [[64 * K, 30.0], [256 * K, 60.0]],
                                 "direct": [[64 * K, 28.0], [256 * K, 40.0]],
                                 "ring": [[64 * K, 27.0], [256 * K, 50.0]],
                                 "one_copy": [[64 * K, 14.5], [256 * K, 30.0]]},
                   "all_reduce": {"native": [[64 * K, 9.0]], "ring": [[64 * K, 5.0]],
                                  "rhd": [[64 * K, 4.0]]}},
                  {"broadcast": {"direct": [[64 * K, 20.0]], "one_copy": [[64 * K, 10.0]],
                                 "ring": [[64 * K, 30.0]]}})
    assert to_check(table, 64 * K, 2, None, "base") == [
        ("base", "broadcast", "one_copy", 64 * K), ("base", "broadcast", "ring", 64 * K),
        ("base", "broadcast", "native", 64 * K), ("base", "all_reduce", "rhd", 64 * K),
        ("base", "all_reduce", "ring", 64 * K), ("base", "all_reduce", "native", 64 * K)]
    assert to_check(table, 64 * K, 2, None, "huge") == [
        ("huge", "broadcast", "one_copy", 64 * K), ("huge", "broadcast", "direct", 64 * K)]
    again = Table({"broadcast": {"one_copy": [[64 * K, 14.0], [256 * K, 29.0]],
                                 "ring": [[64 * K, 7.0]], "direct": [[256 * K, 39.0]],
                                 "native": [[64 * K, 31.0], [256 * K, 20.0]]},
                   "all_reduce": {"rhd": [[64 * K, 4.4]], "ring": [[64 * K, 3.0]],
                                  "native": [[64 * K, 9.0]]}},
                  {"broadcast": {"one_copy": [[64 * K, 10.0]], "direct": [[64 * K, 21.0]]}})
    # broadcast's runner-up ring 27 -> 7 us at 64 KiB; all_reduce's ring 5 -> 3 (1.67x);
    # at 256 KiB only the reference moved
    assert upsets(table, again) == {64 * K: ["broadcast", "all_reduce"]}
    again.times["all_reduce"]["ring"][0][1] = 4.0  # (1.25x: kept)
    again.on_huge_pages["broadcast"]["direct"][0][1] = 40.0  # slower too: on huge pages
    again.times["broadcast"]["ring"][0][1] = 26.0
    assert upsets(table, again) == {64 * K: ["broadcast"]}
    again.on_huge_pages["broadcast"]["direct"][0][1] = 21.0
    assert upsets(table, again) == {}


def test_the_largest_size_measured_fits_its_time():
    """The tuning pass measures 16 MiB where one of each call there is foreseen to take at
    most LARGEST_SIZE_SECONDS (from the 2 MiB calls' time, by bytes), else 8 or 4 MiB; and
    there as many calls as fit in that time, up to the most it is given (at least as many
    as any 16 MiB call gets: 3)."""
    from commlib import tuning

    class OneRank:
        def all_reduce(self, array, op):
            pass
    fits = tuning._affordable
    assert tuning.LARGEST_SIZE_SECONDS == 2.0  # (the cases below assume it)
    assert fits(OneRank(), 16 << 20, 2 << 20, 0.01, 7) == (16 << 20, 7)  # 0.08 s a call
    assert fits(OneRank(), 16 << 20, 2 << 20, 0.01, 3) == (16 << 20, 3)
    assert fits(OneRank(), 16 << 20, 2 << 20, 0.04, 7) == (16 << 20, 5)  # 0.32 s: 6 fit
    assert fits(OneRank(), 16 << 20, 2 << 20, 0.1, 7) == (8 << 20, 4)  # 3.2 s at 16; 0.4 at 8
    assert fits(OneRank(), 16 << 20, 2 << 20, 1.0, 7) == (4 << 20, 4)  # never below 2 x 2 MiB


def test_parts_read_in_place_from_where_that_wins_at_every_larger_size():
    """direct's all_to_all reads parts in place from the least trial size from which doing
    so won at that size and every larger one (a win amid losses is noise, not a size)."""
    from commlib.tuning import wins_from
    assert wins_from([False, True, False, True, True]) == 3
    assert wins_from([True, True, True]) == 0
    assert wins_from([True, True, False]) == 3  # never
    assert wins_from([]) == 0


def test_between_torchrun_nodes_small_calls_ride_in_the_check():
    """Over gloo a checked call costs the check's all-gather and then gloo's collective;
    eager is that all-gather alone, so it wins small calls, and is refused past the rows'
    fixed length. Unchecked (COMMLIB_CHECK=0) gloo's and hier's costs lose the check."""
    offers = frozenset({"hosts", "gloo", "eager"})
    checked = Where("hosts", 2, cross="gloo")
    unchecked = Where("hosts", 2, cross="gloo", checked=False)
    for collective in ("all_reduce", "broadcast", "all_gather", "reduce"):
        assert choose(collective, None, 4, 64, DEFAULTS, where=checked,
                      offers=offers).name == "eager", collective
    assert choose("all_reduce", None, 4, 64 << 10, DEFAULTS, where=checked,
                  offers=offers).name != "eager"
    with pytest.raises(ValueError, match="eager sends at most 4096 bytes"):
        choose("all_reduce", "eager", 4, 8192, DEFAULTS, where=checked, offers=offers)
    choose("all_reduce", "eager", 4, 8192, DEFAULTS, offers=frozenset({"mpi", "eager"}))  # MPI
    assert choose("all_reduce", None, 4, 64, DEFAULTS, where=unchecked,
                  offers=offers).name == "hier"
    gloo = get("all_reduce", "gloo", offers)
    assert DEFAULTS.cost(gloo, unchecked, 4, 64) < DEFAULTS.cost(gloo, checked, 4, 64)


def test_the_pass_times_huge_pages_where_auto_decides_by_them():
    """all_to_all on huge pages at every size (its one choice weighs them all); the other
    collectives one_copy runs where the buffer the peers read fills a huge page (auto
    decides by pages only there): reduce_scatter's input holds a block per rank."""
    from commlib.algorithms.pages import huge_page_bytes
    from commlib.tuning import timed_on_huge_pages
    huge = huge_page_bytes()
    assert timed_on_huge_pages("all_to_all", 2, 256)
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        assert not timed_on_huge_pages(collective, 1, huge // 2)
        assert timed_on_huge_pages(collective, 1, huge)
    assert timed_on_huge_pages("reduce_scatter", 4, huge // 4)
    assert not timed_on_huge_pages("all_reduce", 4, huge // 4)
    assert not timed_on_huge_pages("reduce", 1, 8 * huge)  # (one_copy runs no reduce)


def test_every_timed_call_runs_on_an_input_written_just_before():
    """The pass writes each call's input (all of it: reduce_scatter's holds a block per
    rank) before each timed call, as a training step writes a gradient: a reader in place
    must not find the lines it read last time in its own cache (compare --fresh)."""
    import numpy as np

    from commlib import tuning
    from commlib.collectives import COLLECTIVES
    n, count = 3, 5
    a, b = np.full(count * n, 7.0, np.float32), np.zeros(count * n, np.float32)
    found = []  # (collective, whether its whole input was freshly written)

    class Recording:
        def __getattr__(self, collective):
            def call(*buffers, algorithm):
                inp = buffers[-1]
                found.append((collective, len(inp), bool((inp == 1).all())))
                a[:] = 7  # (a call leaves the input as it may: no longer what was written)
            return call
    calls = [tuning._call(Recording(), c, "any", a, b, count) for c in COLLECTIVES]
    tuning._times(lambda: None, calls, rounds=2)
    timed = found[len(COLLECTIVES):]  # (after the warm-up)
    assert [c for c, _, _ in timed] == list(COLLECTIVES) * 2
    assert all(written for _, _, written in timed), timed
    assert {c: size for c, size, _ in timed}["reduce_scatter"] == count * n


def test_a_link_near_a_class_boundary_takes_a_neighbours_table(monkeypatch):
    """Across hosts the layout names the link's speed class (log2 bytes/s); a speed that
    wanders across a boundary looks up the nearest class, then the neighbours, nearer
    first, so that one table serves the link instead of one per class it wanders into."""
    from types import SimpleNamespace

    from commlib import tuning

    world = SimpleNamespace(allgather=lambda value: ["host1", "host2"])
    transport = SimpleNamespace(world=world, where=Where("hosts", cross="net"))
    comm = SimpleNamespace(transport="hosts", size=2)
    for speed, want in ((31.4, [31, 32, 30]), (30.6, [31, 30, 32]), (27.0, [27, 26, 28])):
        monkeypatch.setattr(tuning, "_link_speed", lambda comm, speed=speed: speed)
        layouts = tuning._layouts(comm, transport)
        assert [lay["link"] for lay in layouts] == want
        assert {k: v for k, v in layouts[0].items() if k != "link"} == \
            {k: v for k, v in layouts[2].items() if k != "link"}
    world.allgather = lambda value: ["host1", "host1"]  # one host: no link in the layout
    assert [("link" in lay) for lay in tuning._layouts(comm, transport)] == [False]
