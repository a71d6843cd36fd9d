"""Self-tuning (commlib/tuning.py): the table measured at the first communicator of a
layout, cached, reused; every rank chooses the same algorithm even when their own caches
say otherwise; a cached table of another layout is ignored with a warning; off is off.

Usage: mpiexec -n N python tests/mpi/tuning.py CACHE_DIR   (N >= 2; each rank caches under
CACHE_DIR/rank<r>, as ranks on different hosts would)
"""
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

rank = MPI.COMM_WORLD.rank
os.environ["XDG_CACHE_HOME"] = str(Path(sys.argv[1]) / f"rank{rank}")
os.environ.pop("COMMLIB_TUNING", None)

import commlib  # noqa: E402
from commlib import tuning  # noqa: E402
from commlib.algorithms import entries  # noqa: E402
from commlib.algorithms import pages  # noqa: E402
from commlib.collectives import COLLECTIVES  # noqa: E402
from harness import Checker  # noqa: E402

world = commlib.init()
n = world.size
check = Checker()
tables = Path(os.environ["XDG_CACHE_HOME"]) / "commlib" / "tables"


def auto_choices(comm):
    """The algorithm auto takes for each collective at a few sizes (flight recorder)."""
    chosen = []
    for count in (16, 5000, 300_000):
        a, b = np.ones(count * n, np.float32), np.zeros(count * n, np.float32)
        comm.all_reduce(a[:count])
        comm.reduce_scatter(b[:count], a)
        comm.all_gather(b, a[:count])
        comm.broadcast(a[:count])
        comm.reduce(a[:count])
        comm.all_to_all(b[:count * n], a[:count * n])
        chosen += [(r["collective"], r["count"], r["algorithm"])
                   for r in comm.flight_record()[-6:]]
    return chosen


def measured_and_cached():
    table = world.algorithm_table
    assert table is not None, "no table attached to the world"
    for collective in COLLECTIVES:
        assert set(table.times[collective]) == set(world.algorithms(collective)), collective
    for collective in tuning.ON_HUGE_PAGES_TOO:
        assert set(table.on_huge_pages[collective]) == set(world.algorithms(collective))
        if "one_copy" in world.algorithms(collective):  # (and in regions, one_copy alone)
            assert set(table.in_regions[collective]) == {"one_copy"}, collective
    # how to read in place, measured where algorithms do, and in force
    reads = world._transport
    if "one_copy" in world.algorithms("all_gather"):
        assert set(table.base_pages_in_place) <= set(COLLECTIVES)
        assert reads.base_pages_in_place == set(table.base_pages_in_place)
        assert table.parts_in_place_from >= 0
        assert reads.parts_in_place_from == table.parts_in_place_from
    else:
        assert (table.base_pages_in_place, table.parts_in_place_from) == ([], -1)
    # refined: where neighbouring sizes' winners differ, they are at most 2x apart
    retimed = {(c, b) for c in COLLECTIVES for b in table.sizes()}
    assert tuning.to_time_again(table, n, world._transport.where, retimed) == {}
    files = sorted(tables.glob("*.json"))
    if rank == 0:
        assert len(files) == 1, files
        data = json.loads(files[0].read_text())
        assert data["layout"]["version"] == tuning.VERSION and data["layout"]["ranks"] == n
        assert (data["base_pages_in_place"], data["parts_in_place_from"]) == \
            (table.base_pages_in_place, table.parts_in_place_from)
    else:
        assert not files, "only rank 0 writes the table"


def the_choice_is_the_tables_and_the_same_everywhere():
    chosen = auto_choices(world)
    every = world.mpi.allgather(chosen)
    assert all(c == every[0] for c in every), every
    table = world.algorithm_table
    for collective, count, name in chosen:
        nbytes = None if collective == "all_to_all" else count * 4  # (one choice for all)
        names = world.algorithms(collective)
        base = table.fastest(collective, nbytes, names)
        huge = table.fastest(collective, nbytes, names, memory="huge")
        by_pages = huge not in (None, base) and pages.worth_deciding_by_pages(
            table, collective, n, nbytes, entries(collective)[base],
            entries(collective)[huge])
        if by_pages:  # (one_copy decides by its own meeting, the rest by a flag)
            base = pages.by_pages(entries(collective)[huge], entries(collective)[base],
                                  collective in table.base_pages_in_place).name
        assert name == base, (collective, count, name)


def a_new_table_replaces_what_auto_chose():
    """Auto's choices so far, on the general path and the fast one, give way to a table
    set later (as they must to the table measured after the calls that measure it)."""
    comm = world.dup()
    a = np.ones(16, np.float32)

    def chosen():
        comm.all_reduce(a)
        comm.all_reduce(a)  # (the fast path's, where the transport has one)
        return [r["algorithm"] for r in comm.flight_record()[-2:]]
    before = chosen()
    other = next(name for name in comm.algorithms("all_reduce") if name != before[0] and
                 not (entries("all_reduce")[name].refuses or (lambda *_: None))(n, 64))
    times = {"all_reduce": {name: [[256, 1e-9 if name == other else 1.0]]
                            for name in comm.algorithms("all_reduce")}}
    comm.algorithm_table = tuning.Table(times)
    assert chosen() == [other, other], (before, other, chosen())
    comm.free()


def rank_0s_table_wins():
    """The other ranks' caches hold a forged table (only the slowest algorithm fast): a
    new communicator of the layout still takes rank 0's, and so the same choices."""
    mine = sorted(Path(sys.argv[1], "rank0", "commlib", "tables").glob("*.json"))
    data = json.loads(world.mpi.bcast(mine[0].read_text() if rank == 0 else None))
    name = world.mpi.bcast(mine[0].name if rank == 0 else None)
    if rank != 0:
        for collective, algos in data["times"].items():
            slowest = max(algos, key=lambda a: algos[a][-1][1])
            for a, points in algos.items():
                for p in points:
                    p[1] = 1e-9 if a == slowest else 1.0
        tables.mkdir(parents=True, exist_ok=True)
        (tables / name).write_text(json.dumps(data))
    tuning._tables.clear()  # as in a new process: read from the caches
    fresh = world.dup()
    every = world.mpi.allgather(auto_choices(fresh))
    assert all(c == every[0] for c in every), every
    assert fresh.algorithm_table.times == world.algorithm_table.times
    fresh.free()


def passes_while(action) -> int:
    """How many tuning passes ``action`` runs; each here returns the world's table at once
    (measured_and_cached checks the real pass: its time is spent once)."""
    real, passes = tuning.measure, []
    tuning.measure = lambda *args, **kwargs: passes.append(1) or world.algorithm_table
    try:
        action()
    finally:
        tuning.measure = real
    return len(passes)


def another_layouts_table_is_ignored():
    """Rank 0's cached file says another layout: a warning, a new measurement, a new file."""
    path = sorted(Path(sys.argv[1], "rank0", "commlib", "tables").glob("*.json"))[0] \
        if rank == 0 else None
    if rank == 0:
        data = json.loads(path.read_text())
        data["layout"]["cpu"] = "some other CPU"
        path.write_text(json.dumps(data))
    tuning._tables.clear()
    fresh = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert passes_while(lambda: fresh.append(world.dup())) == 1
    fresh = fresh[0]
    if rank == 0:
        assert any("another machine or layout" in str(w.message) for w in caught), caught
        assert json.loads(path.read_text())["layout"]["cpu"] != "some other CPU"
    assert fresh.algorithm_table is not None
    fresh.free()


def a_table_serves_communicators_with_fewer_algorithms():
    """One table per layout: taken by a communicator whose algorithms it measured, more
    among them (mpiexec's world measures MPI's own, torchrun's runs without it), and
    measured again for one that runs an algorithm it lacks."""
    path = sorted(tables.glob("*.json"))[0] if rank == 0 else None

    def rewritten(change):
        if rank == 0:
            data = json.loads(path.read_text())
            change(data["times"]["all_reduce"])
            path.write_text(json.dumps(data))
        tuning._tables.clear()
        fresh = []
        passes = passes_while(lambda: fresh.append(world.dup()))
        times = fresh[0].algorithm_table.times["all_reduce"]
        fresh[0].free()
        return passes, times
    passes, extra = rewritten(lambda algos: algos.update(other=algos["ring"]))
    assert passes == 0 and "other" in extra, \
        "a table measured with one more algorithm was measured again"
    dropped = world.algorithms("all_reduce")[0]
    passes, again = rewritten(lambda algos: algos.pop(dropped))
    assert passes == 1 and "other" not in again, "a table lacking one was taken"


def deterministic_communicators_take_the_table_and_never_measure():
    plain, det = world.dup(), world.dup(deterministic=True)
    assert det.algorithm_table.times == plain.algorithm_table.times  # the layout's
    tuning._tables.clear()
    if rank == 0:
        for f in tables.glob("*.json"):
            f.unlink()
    fresh = world.dup(deterministic=True)  # no table anywhere: the cost model, no pass
    assert fresh.algorithm_table is None or n <= 2  # (between 2 ranks nothing is refused)
    if n > 2:
        try:
            fresh.measure_algorithms()
        except ValueError as e:
            assert "deterministic mode" in str(e), e
        else:
            raise AssertionError("a deterministic communicator measured its algorithms")
    for c in (plain, det, fresh):
        c.free()


def the_calls_memory_decides_where_the_kinds_differ():
    """A table whose fastest differ by the kind of pages: one_copy on huge pages and ring
    (all_gather) or tree (broadcast) on 4 KiB ones, one_copy on 4 KiB pages and direct on
    huge ones (all_to_all). Where one_copy is the huge pages' choice its own meeting decides
    (it reads in place only where every rank's buffers lie on huge pages, else stages by
    the other's schedule), on the general path and the fast one alike; else the ranks agree
    on a flag (pages.chosen). Results exact."""
    comm = world.dup()
    table = tuning.Table({}, {})
    kinds = {"all_gather": ("ring", "one_copy"), "broadcast": ("tree", "one_copy"),
             "all_to_all": ("one_copy", "direct")}  # (on 4 KiB pages, on huge ones)
    for c, (base, huge) in kinds.items():
        table.put([("base", c, base, 1 << 20), ("base", c, huge, 1 << 20),
                   ("huge", c, base, 1 << 20), ("huge", c, huge, 1 << 20)],
                  [1.0, 2.0, 2.0, 1.0])
    comm.algorithm_table = table
    shm = comm._transport.shm
    ran = []
    choose = pages.chosen
    pages.chosen = lambda *args: ran.append(choose(*args)) or ran[-1]
    try:
        count = 1 << 19  # 2 MiB of float32 per part
        for mine in ("huge", "small", "huge", "small") if n > 1 else ():
            memory = tuning._huge_pages if mine == "huge" or rank else tuning._small_pages
            out, inp = memory(count * n), memory(count * n)
            inp[:] = np.arange(count * n) + rank
            out[:] = 0  # (its pages, before the broadcast's root says where they lie)

            def on_huge_pages(*call, **args):  # (every rank's buffer that peers read)
                return all(comm.mpi.allgather(pages.on_huge_pages(
                    commlib.call.make(*call, **args), rank)))
            huge = on_huge_pages("all_to_all", n, rank, out, inp)
            read = on_huge_pages("all_gather", n, rank, out, inp[:count]) + \
                on_huge_pages("broadcast", n, rank, out, root=0)
            thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
            assert huge or mine == "small" or not thp.exists() or "[never]" in thp.read_text()
            in_place = shm.calls_read_in_place
            comm.all_gather(out, inp[:count])
            assert all((out[r * count:(r + 1) * count] == np.arange(count) + r).all()
                       for r in range(n))
            out[:] = rank
            comm.broadcast(out, root=0)  # (the root's pages decide: nobody reads the others)
            assert (out == 0).all()
            assert shm.calls_read_in_place - in_place == read, \
                (mine, shm.calls_read_in_place - in_place)
            comm.all_to_all(out, inp)
            assert all((out[r * count:(r + 1) * count] ==
                        np.arange(rank * count, (rank + 1) * count) + r).all()
                       for r in range(n))
            assert ran[-1].name == ("direct" if huge else "one_copy"), (mine, ran)
            assert [r["algorithm"] for r in comm.flight_record()[-3:]] == \
                ["one_copy", "one_copy", "pages"]
    finally:
        pages.chosen = choose
    comm.free()


def regions_take_one_copy_once_the_communicator_has_some():
    """A table where one_copy, timed in regions, beats what won on 4 KiB pages (ring,
    direct): auto runs that until the communicator hands out regions (Communicator.empty);
    then a call whose buffers lie in regions on every rank runs one_copy in place, on the
    general path and the fast one, and one where any rank's lie elsewhere (on huge pages
    too, which one_copy would read in place) stages by the table's choice. Results exact."""
    comm = world.dup()
    shm = getattr(comm._transport, "shm", None)
    if shm is None or "one_copy" not in comm.algorithms("all_gather"):
        return comm.free()  # (no regions where the ranks share no memory)
    table = tuning.Table({}, {})
    base = {c: "direct" if c == "all_to_all" else "ring" for c in tuning.ON_HUGE_PAGES_TOO}
    for c, name in base.items():
        for nbytes in (1 << 10, 1 << 24):
            table.put([("base", c, name, nbytes), ("base", c, "one_copy", nbytes),
                       ("regions", c, "one_copy", nbytes)], [1.0, 2.0, 0.5])
    comm.algorithm_table = table
    count = 3001  # (not a multiple of the ranks)

    def all_gather(out, inp):
        inp[:] = np.arange(count) + rank
        comm.all_gather(out, inp)
        assert all((out[r * count:(r + 1) * count] == np.arange(count) + r).all()
                   for r in range(n))
        return comm.flight_record()[-1]["algorithm"]

    def read_in_place(call) -> int:
        before = shm.calls_read_in_place
        call()
        return shm.calls_read_in_place - before

    private = np.zeros(count * n, np.float32), np.zeros(count, np.float32)
    assert [all_gather(*private) for _ in range(2)] == ["ring", "ring"]
    out, inp = comm.empty(count * n), comm.empty(count)
    assert read_in_place(lambda: all_gather(out, inp)) == 1  # the general path's
    assert read_in_place(lambda: all_gather(out, inp)) == 1  # the fast path's
    assert comm.flight_record()[-1]["algorithm"] == "one_copy"
    mixed = (out, inp) if rank else private  # rank 0's on private memory
    assert read_in_place(lambda: all_gather(*mixed)) == 0
    assert read_in_place(lambda: all_gather(*mixed)) == 0
    huge = tuning._huge_pages(1 << 19)
    huge[:] = rank  # (its pages, which one_copy would read in place: mostly_huge)
    assert read_in_place(lambda: comm.broadcast(huge, root=0)) == 0
    assert (huge == 0).all()
    a = comm.empty(count)
    for _ in range(2):
        a[:] = rank + 1
        assert read_in_place(lambda: comm.all_reduce(a)) == 1
        assert (a == n * (n + 1) / 2).all()
        parts, got = comm.empty(count * n), np.zeros(count * n, np.float32)
        mine = parts if rank else np.zeros(count * n, np.float32)  # (what the peers read)
        mine[:] = parts[:] = np.repeat(np.arange(n) + 10 * rank, count)
        assert read_in_place(lambda: comm.all_to_all(got, mine)) == 0
        assert (got == np.repeat(10 * np.arange(n) + rank, count)).all()
        got[:] = 0
        assert read_in_place(lambda: comm.all_to_all(got, parts)) == 1
        assert (got == np.repeat(10 * np.arange(n) + rank, count)).all()
    comm.free()


def off_is_off():
    os.environ["COMMLIB_TUNING"] = "off"
    try:
        fresh = world.dup()
        assert fresh.algorithm_table is None
        fresh.free()
    finally:
        del os.environ["COMMLIB_TUNING"]


if n >= 2:
    for case in (measured_and_cached, the_choice_is_the_tables_and_the_same_everywhere,
                 a_new_table_replaces_what_auto_chose, rank_0s_table_wins,
                 another_layouts_table_is_ignored,
                 a_table_serves_communicators_with_fewer_algorithms,
                 the_calls_memory_decides_where_the_kinds_differ,
                 regions_take_one_copy_once_the_communicator_has_some,
                 deterministic_communicators_take_the_table_and_never_measure, off_is_off):
        check.check(case.__name__, case)
check.finish()
