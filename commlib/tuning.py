"""Self-tuning: the algorithm table, measured on the machine and layout it runs on.

The first communicator of a layout (transport, ranks on each host, CPU model, cores, the
algorithms on offer) times every algorithm of every collective at a few sizes, each call
from a common start (MPI's barrier) as the benchmark does (``compare --fresh``: each on an
input written just before, as a training step writes a gradient): each rank takes the
median of a few calls, and the table keeps the slowest rank's time, so every rank computes
the same table. Buffers lie on 4 KiB pages, where torch's do; all_to_all, whose choice
cannot depend on the size, and the copies (all_gather, broadcast), which one_copy reads in
place on huge pages, are timed on huge pages too (where numpy's large arrays lie), and
one_copy in memory every rank maps (Communicator.empty's regions, which it reads through
its own mapping). How the algorithms that read the peers' memory in place read is measured
first, and holds for the rest of the pass and wherever the table is used: for which
collectives buffers on 4 KiB pages are read in place too, rather than staged (the kernel
pins every page it reads: dearer than staging on one machine, cheaper on another), and from
what size of its parts direct's all_to_all reads a rank's parts in place. It is cached in
the user's cache directory (a versioned JSON file) and reused by every later communicator
of that layout, in this process and the next. ``auto`` then takes the algorithm with the
least time at the call's size, interpolated in log size between measured sizes (where two
neighbouring sizes' winners differ, sizes between them are measured too, until the
crossover lies within a factor of 2; a size timed during a slow spell, its reference
collective's times off from the same calls timed again at the end, is measured again, and
so is a collective at a size where its two fastest's were; beyond the largest, time grows
with the bytes); where both kinds of pages were timed and their fastest differ, the call's
own memory decides, and where a communicator has handed out regions, one_copy takes the
calls that lie in them where it ran faster there (commlib/algorithms/pages.py); collectives
or algorithms the table lacks fall back to the cost model (commlib/select.py). Rank 0's
table is the one every rank uses, so two ranks never choose differently.

COMMLIB_TUNING=off keeps the cost model's choice; COMMLIB_TUNING=refresh measures again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from . import settings, survivors
from .algorithms import entries
from .algorithms.pages import fills_a_huge_page, mapped
from .collectives import COLLECTIVES, of as collective_of
from .errors import CommError
from .host_memory import as_array
from .table import MEMORIES, Table

VERSION = 16  # 16: TCP between the hosts (the net transport), what joins them and how fast
# (the link's class) in the layout;
# 15: one_copy in regions (Communicator.empty's) too; 14: every call on an
# input written just before it; 13: the reductions on
# huge pages too, from a huge page's size (as the copies); 12: a collective
# whose two fastest moved in a spell is measured again;
# 11: one table per layout serves every communicator whose algorithms it
# measured (torchrun's world, without MPI's own, takes the table mpiexec's world measured);
# 10: sizes measured again after spells, and between differing winners;
# 9: up to 7 calls at the largest size on one host, not 3; 8: all_gather and broadcast on
# huge pages too (none across hosts); 7: copies stream from half the cache (csrc/shm.h);
# 6: how to read in place
# primary bytes measured per rank (64 KiB: eager's largest among few ranks)
SIZES = (256, 4 << 10, 64 << 10, 256 << 10, 2 << 20, 16 << 20)
CALLS = 16  # timed per size up to 1 MiB; fewer above (8 at 2 MiB), down to FEWEST_CALLS
FEWEST_CALLS = 3  # (a median), but at the largest size on one host: LARGEST_CALLS
# seconds the largest size may take, foreseen from the one before it: where the transport
# is slow (TCP between hosts on shared cores: 5.6 s at 16 MiB, 2 x 2 ranks here) a smaller
# largest size is measured instead (8 or 4 MiB), and auto extrapolates beyond it
LARGEST_SIZE_SECONDS = 2.0
# calls timed at the largest size on one host, where they fit in LARGEST_SIZE_SECONDS
# (else, and across hosts, FEWEST_CALLS): at 16 MiB the machine's spells move a call's time by a
# fifth or more, and a median of 3 picked one_copy for a broadcast that tree did in
# 0.6-0.8 of its time (2 ranks: 4 passes of 7 agreed on tree; the pass took 1.0 s, not
# 0.68). Across hosts the later calls of the socket algorithms ran faster than the first
# (TCP warming up): with 7, two passes at 2 x 1 took `ring` for a 16 MiB broadcast that
# ran at 0.73 of MPI's in the benchmark, where 3 matched the benchmark's times
LARGEST_CALLS = 7
# timed on huge pages too, where auto's choice then follows the call's memory
# (commlib/algorithms/pages.py): the collectives one_copy runs, for it reads huge pages in
# place (numpy's large arrays lie on them) at a meeting's cost where 4 KiB ones stage;
# all_to_all at every size (its one choice, for every size, weighs them all), the others
# where a buffer fills a huge page (only there auto decides by pages: timed_on_huge_pages)
ON_HUGE_PAGES_TOO = ("all_to_all", "all_gather", "broadcast", "reduce_scatter", "all_reduce")
_tables: dict = {}  # layout digest -> table, in this process (agreed ones only)


def mode() -> str:
    """COMMLIB_TUNING: "off", "refresh", or anything else (on)."""
    return settings.get("COMMLIB_TUNING").strip().lower()


def table_for(comm, transport, refresh: bool = False, may_measure: bool = True
              ) -> "Table | None":
    """The algorithm table of ``comm``'s layout (measured now if there is none yet and
    ``may_measure``, or ``refresh``), or None: tuning is off. Collective over ``comm``. A
    communicator in deterministic mode takes its layout's table if there is one, and is
    never measured on (its calls refuse most algorithms)."""
    if (mode() == "off" and not refresh) or comm.size == 1:
        return None
    if refresh and transport.rank_order:
        raise ValueError("measure_algorithms: this communicator is in deterministic mode, "
                         "whose calls refuse most algorithms; measure on one that is not "
                         "(comm.dup(deterministic=False)): the table serves its layout")
    layouts = _layouts(comm, transport)
    layout = layouts[0]
    digest = _digest(layout)
    table = None
    if comm.rank == 0 and mode() != "refresh" and not refresh:
        for other in layouts:  # (a link near the boundary of its class: either one's)
            table = _tables.get(_digest(other)) or _load(_digest(other), other)
            if table is not None and not table.measured(comm):
                table = None  # measured by a communicator with fewer algorithms: measure all
            if table is not None:
                digest = _digest(other)
                break
    table = Table.rank_0s(transport.world, table)
    if table is None and (transport.rank_order or not may_measure):
        return None  # (its calls could not time every algorithm: the cost model chooses)
    if table is None:
        started = time.perf_counter()
        table = measure(comm, _starting_line(comm, transport), transport)
        if comm.rank == 0:
            _save(digest, layout, table, time.perf_counter() - started)
    _tables[digest] = table
    return table


def describe(comm, transport) -> dict:
    """What a table is valid for (rank 0's is the one looked up). Not the algorithms: the
    worlds of mpiexec and of torchrun on one host run the same transport, one with MPI's
    own algorithm too; one table, measured by the one with more, chooses for both alike
    (Table.measured), rather than two measured apart deciding near-ties by noise."""
    return _layouts(comm, transport)[0]


def _layouts(comm, transport) -> list[dict]:
    """describe's layout, then, across hosts, the same with the link's neighbouring
    classes, the nearer first: a link whose speed wanders across a class's boundary (on
    veth the same link measured 2^30.6 to 2^32.4 bytes a second) takes a table of either,
    rather than two or three tables, each measured once, taking turns by the link's
    noise."""
    hosts = Counter(transport.world.allgather(survivors.whoami()[0]))
    layout = {"version": VERSION, "transport": comm.transport, "cross": transport.where.cross,
              "ranks": comm.size, "per_host": sorted(hosts.values()), "cpu": _cpu_model(),
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count()}
    if len(hosts) == 1:
        return [layout]
    speed = _link_speed(comm)
    nearest = round(speed)
    return [{**layout, "link": c} for c in sorted((nearest, nearest - 1, nearest + 1),
                                                   key=lambda c: abs(c - speed))]


def _digest(layout: dict) -> str:
    return hashlib.sha1(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def _link_speed(comm) -> float:
    """How fast the hosts' link is, as log2 of bytes a second through a 1 MiB all_reduce
    (the slowest rank's median of 3); its class is this to a factor of 2: a table measured
    on one network chooses for another as badly as for another machine (a 1 Gbit/s link
    and veth alone differ 10x, and the order of the algorithms with them). Collective."""
    buf = np.zeros(1 << 18, np.float32)
    comm.all_reduce(buf)  # (warm)
    took = []
    for _ in range(3):
        comm.barrier()
        began = time.perf_counter()
        comm.all_reduce(buf)
        took.append(time.perf_counter() - began)
    seconds = np.array([np.median(took)])
    comm.all_reduce(seconds, op="max")
    return math.log2(2 * buf.nbytes / max(seconds[0], 1e-9))


def measure(comm, start=None, transport=None) -> Table:
    """Time every algorithm of every collective at SIZES on ``comm`` (the largest, or a
    smaller one where it would take too long: LARGEST_SIZE_SECONDS); collective. First,
    where ``transport`` (comm's) reads in place, how it should (_how_to_read_in_place),
    which then holds for the pass. The algorithms of a size share their buffers, on 4 KiB
    pages (where a user's may lie: torch's do), ON_HUGE_PAGES_TOO's on huge pages too, and
    a collective's algorithms take turns call by call, so that none is timed on memory in
    another state and a slow spell of the machine hits those compared alike. Each timed
    call follows ``start()`` (default ``comm.barrier``) on every rank. Huge pages and
    regions are timed only where the transport reads peers' memory in place (on one
    host; regions where it runs one_copy). Then sizes
    whose reference times, or collectives whose two fastest's, were off in a spell of the
    machine are measured again (_distrust_spells), and sizes between measured ones where
    the winner changes (_refine)."""
    start = start or comm.barrier
    reading = ((), -1)
    # (memory's kind matters only where peers' memory is read in place: shared memory)
    reads_in_place = transport is not None and transport.base_pages_in_place is not None
    one_copy = "one_copy" in comm.algorithms("all_gather")
    if reads_in_place and one_copy:
        reading = _how_to_read_in_place(comm, transport, start)
    memories = {"base": _small_pages}
    if reads_in_place:
        memories["huge"] = _huge_pages
    if reads_in_place and one_copy and transport.memory is not None:
        memories["regions"] = _in_regions(transport.memory)
    where = transport.where if transport is not None else None  # (None: as under MPI)
    table = Table({}, {}, *reading)
    before = (0, 0.0)  # (bytes, seconds that one of each call took there)
    for nbytes in SIZES:
        rounds = _rounds(nbytes)
        if nbytes == SIZES[-1]:
            nbytes, rounds = _affordable(comm, nbytes, *before,
                                         LARGEST_CALLS if reads_in_place else FEWEST_CALLS)
        keys, mine = _time_at(comm, start, nbytes, rounds, COLLECTIVES, memories, where)
        table.put(keys, mine)  # (this rank's: their sum foresees the largest size's time)
        before = (nbytes, sum(mine))
    table.put(*_slowest(comm, table))
    _distrust_spells(comm, start, table, memories, where)
    _refine(comm, start, table, memories, where)
    if "regions" in memories:
        transport.memory.drop_freed()  # (the peers unmap the pass's regions now)
    return table


def _time_at(comm, start, nbytes: int, rounds: int, collectives, memories: dict,
             where) -> tuple[list, list]:
    """(keys, this rank's seconds) of every algorithm of ``collectives`` that runs
    ``nbytes`` at ``where``, on each of ``memories`` (kind -> what allocates it) that they
    are timed on (timed_on); a key is (memory, collective, name, bytes)."""
    n, count = comm.size, _count(comm.size, nbytes)
    keys, mine = [], []
    for memory, allocate in memories.items():
        timed = [c for c in collectives if timed_on(memory, c, n, nbytes)]
        try:
            a, b = _buffers(allocate, n, count) if timed else (None, None)
        except CommError:  # (regions: /dev/shm full, say; on every rank alike)
            continue
        for collective in timed:
            calls = []  # (a collective's algorithms take turns among themselves)
            for name in comm.algorithms(collective):
                refuses = entries(collective)[name].refuses
                if (refuses and refuses(n, nbytes, where)) or \
                        (memory == "regions" and name != "one_copy"):
                    continue  # (never chosen there: select.choose asks it too)
                keys.append((memory, collective, name, nbytes))
                calls.append(_call(comm, collective, name, a, b, count))
            mine.extend(_times(start, calls, rounds))
    return keys, mine


def timed_on(memory: str, collective: str, n: int, nbytes: int) -> bool:
    """Whether the pass times ``collective`` at ``nbytes`` among ``n`` ranks on ``memory``
    (each on 4 KiB pages; in regions, those one_copy runs)."""
    if memory == "huge":
        return timed_on_huge_pages(collective, n, nbytes)
    return memory == "base" or collective in ON_HUGE_PAGES_TOO


def timed_on_huge_pages(collective: str, n: int, nbytes: int) -> bool:
    """Whether the pass times ``collective`` at ``nbytes`` among ``n`` ranks on huge pages
    too."""
    return collective in ON_HUGE_PAGES_TOO and \
        (collective_of(collective).uneven or fills_a_huge_page(collective, n, nbytes))


def _slowest(comm, table: "Table") -> tuple[list, list]:
    """The table's points as (keys, the slowest rank's seconds): what every rank keeps."""
    keys = [(memory, c, name, nbytes) for memory in MEMORIES
            for c, algos in table.of(memory).items() for name, points in algos.items()
            for nbytes, _ in points]
    slowest = np.array([table.at(key) for key in keys])
    comm.all_reduce(slowest, op="max")
    return keys, slowest.tolist()


# A pass whose reference (MPI's own collectives, else direct) ran SPELL times slower or
# faster at a size than when timed again at the pass's end met a spell of the machine
# there (its speed drifts up to 2x minute to minute): that size is measured again. A
# spell may slow only some algorithms (the staged copies, not MPI's single copy: 64 KiB
# broadcasts by direct timed at 26-29 us in one pass, 4.9-10 in the next three, so that
# one_copy won there at half their speed): so each size's two fastest are timed again
# too, and a collective whose winner or runner-up moved by SPELL is measured again there.
SPELL = 1.5
REFERENCES = ("native", "direct")


def _distrust_spells(comm, start, table: "Table", memories: dict, where) -> None:
    """Time again, at every size of ``table``, each collective's reference and its two
    fastest (on each kind of memory measured), and measure again (in place of what was)
    each size where the pass's reference times were off by SPELL, and each collective at
    a size where its winner's or runner-up's were."""
    n, again = comm.size, Table({}, {})
    for nbytes in table.sizes():
        count = _count(n, nbytes)
        for memory, allocate in memories.items():
            keys = to_check(table, nbytes, n, where, memory)
            try:
                a, b = _buffers(allocate, n, count) if keys else (None, None)
            except CommError:  # (as in _time_at)
                continue
            again.put(keys, _times(start, [_call(comm, c, name, a, b, count)
                                           for _, c, name, _ in keys], _rounds(nbytes)))
    again.put(*_slowest(comm, again))
    todo = {nbytes: list(COLLECTIVES) for nbytes in spells(table, again)}
    for nbytes, collectives in upsets(table, again).items():
        todo.setdefault(nbytes, collectives)
    for nbytes, collectives in sorted(todo.items()):
        keys, mine = _time_at(comm, start, nbytes, _rounds(nbytes), collectives,
                              memories, where)
        slow = Table({})
        slow.put(keys, mine)
        table.put(*_slowest(comm, slow))


def to_check(table: "Table", nbytes: int, n: int, where, memory: str) -> list:
    """The keys timed again at ``nbytes`` on one kind of memory: each collective's two
    fastest there among those that run it, and (on 4 KiB pages) its reference."""
    keys = []
    for c, algos in table.of(memory).items():
        at = {name: t for name in _runs(c, algos, n, nbytes, where)
              for b, t in algos[name] if b == nbytes}
        names = sorted(at, key=at.get)[:2]
        reference = next((r for r in REFERENCES if r in at), None)
        if memory == "base" and reference is not None and reference not in names:
            names.append(reference)
        keys += [(memory, c, name, nbytes) for name in names]
    return keys


def spells(table: "Table", again: "Table") -> list[int]:
    """The sizes at which ``table``'s reference times differ from ``again``'s (the same
    calls timed later) by SPELL or more, in the geometric mean over the collectives."""
    found = []
    for nbytes in table.sizes():
        ratios = [table.at(("base", c, name, nbytes)) / t
                  for c, algos in again.times.items() for name, points in algos.items()
                  for b, t in points if b == nbytes and name == _reference(table, c)]
        if ratios and abs(np.mean(np.log(ratios))) >= math.log(SPELL):
            found.append(nbytes)
    return found


def upsets(table: "Table", again: "Table") -> dict[int, list[str]]:
    """{bytes: collectives} whose winner's or runner-up's time in ``again`` (which holds
    them, as to_check gives) differs from ``table``'s by SPELL or more, on either kind of
    pages or in regions."""
    found: dict = {}
    for memory in MEMORIES:
        for c, algos in again.of(memory).items():
            for nbytes in sorted({b for points in algos.values() for b, _ in points}):
                was = {name: table.at((memory, c, name, nbytes)) for name, points in
                       algos.items() if nbytes in dict(points)}
                moved = [abs(math.log(was[name] / dict(algos[name])[nbytes]))
                         for name in sorted(was, key=was.get)[:2]]
                if max(moved) >= math.log(SPELL) and c not in found.get(nbytes, ()):
                    found.setdefault(nbytes, []).append(c)
    return dict(sorted(found.items()))


def _reference(table: "Table", collective: str) -> str | None:
    return next((r for r in REFERENCES if r in table.times.get(collective, {})), None)


# Where two neighbouring sizes' winners differ, a size between them is timed, until each
# such bracket spans at most 2x; a winner that differs from both its neighbours' is timed
# again first (the lesser time of each algorithm kept). At most REFINING passes of both.
REFINING = 8


def _refine(comm, start, table: "Table", memories: dict, where) -> None:
    retimed: set = set()
    for _ in range(REFINING):
        todo = to_time_again(table, comm.size, where, retimed)
        if not todo:
            return
        for nbytes, collectives in sorted(todo.items()):
            keys, mine = _time_at(comm, start, nbytes, _rounds(nbytes), collectives,
                                  memories, where)
            slow = Table({})
            slow.put(keys, mine)
            table.put(*_slowest(comm, slow), keep_least=True)


def to_time_again(table: "Table", n: int, where, retimed: set) -> dict[int, list[str]]:
    """{bytes: collectives} to time next: each outlier winner once (noted in ``retimed``),
    else a size between neighbours with different winners further than 2x apart. The same
    on every rank (the table is)."""
    outliers, between = {}, {}
    for c in COLLECTIVES:
        if collective_of(c).uneven or c not in table.times:
            continue  # (its choice may not depend on the size: select.py)
        sizes = sorted({b for points in table.times[c].values() for b, _ in points})
        won = [table.fastest(c, b, _runs(c, table.times[c], n, b, where)) for b in sizes]
        for i in range(1, len(sizes) - 1):
            if won[i - 1] != won[i] != won[i + 1] and (c, sizes[i]) not in retimed:
                retimed.add((c, sizes[i]))
                outliers.setdefault(sizes[i], []).append(c)
        for (b0, w0), (b1, w1) in zip(zip(sizes, won), zip(sizes[1:], won[1:])):
            if w0 != w1 and b1 > 2 * b0:
                middle = 1 << round((math.log2(b0) + math.log2(b1)) / 2)
                between.setdefault(min(max(middle, 2 * b0), b1 // 2), []).append(c)
    return outliers or between


def _runs(collective: str, algos: dict, n: int, nbytes: int, where) -> list[str]:
    """The names measured for ``collective`` that run ``nbytes`` among ``n`` ranks."""
    return [name for name in algos if not (entries(collective)[name].refuses and
                                           entries(collective)[name].refuses(n, nbytes, where))]


def _count(n: int, nbytes: int) -> int:
    """Elements (float32) of a call of ``nbytes`` primary bytes: all_to_all's equal parts."""
    return max(n, nbytes // 4 // n * n)


def _buffers(memory, n: int, count: int) -> tuple:
    """Two buffers of ``count * n`` elements on ``memory`` (_small_pages or _huge_pages),
    the input's ones, the output's zeros."""
    a, b = memory(count * n), memory(count * n)
    a[:], b[:] = 1, 0
    return a, b


# The trials that fix how the transport reads in place, before the rest of the pass: each
# one_copy collective at a size in the caches and one beyond on 4 KiB pages, staged against
# in place; then direct's all_to_all, staged against in place, at what a rank sends.
BASE_PAGES_TRIAL = (256 << 10, 2 << 20)
PARTS_TRIAL = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
NEVER = 1 << 62  # parts_in_place_from where reading in place never pays in the trial


def _how_to_read_in_place(comm, transport, start) -> tuple[list, int]:
    """(base_pages_in_place, parts_in_place_from) as measured here, and set on
    ``transport`` (collective; alike on every rank: each verdict is the slowest rank's).

    A collective reads buffers on base pages in place where its one_copy calls on them run
    faster so than staged (the geometric mean of the ratios at BASE_PAGES_TRIAL): the
    kernel pins every page it reads, which on a 2-core AMD EPYC cost more than staging
    (4 MiB all_to_all at 2 ranks: 173 us against 113), and on a 2-core Intel Xeon less,
    except for broadcast and all_gather at 4 ranks (their readers pin the same pages at
    once). direct's all_to_all then reads a rank's parts in place from the least size (a
    rank sends it all: its parts are an n-th) from which doing so is faster at every
    size of the trial, on memory it reads in place (base pages where it does, else huge
    pages); where it is never faster, never."""
    collectives = [c for c in COLLECTIVES if "one_copy" in comm.algorithms(c)]
    times = _slowest_times(comm, start, BASE_PAGES_TRIAL, _small_pages, lambda count, a, b: [
        _with(transport, "base_pages_in_place", [c] if on else [],
              _call(comm, c, "one_copy", a, b, count))
        for c in collectives for on in (False, True)])
    gain = np.sum(np.log(times[:, 1::2] / times[:, 0::2]), axis=0)  # < 0: in place wins
    base = transport.base_pages_in_place = [c for c, g in zip(collectives, gain) if g < 0]
    times = _slowest_times(comm, start, PARTS_TRIAL,
                           _small_pages if "all_to_all" in base else _huge_pages,
                           lambda count, a, b: [
        _with(transport, "parts_in_place_from", bytes_from,
              _call(comm, "all_to_all", "direct", a, b, count)) for bytes_from in (NEVER, 0)])
    first = wins_from(times[:, 1] < times[:, 0])
    parts = NEVER if first == len(PARTS_TRIAL) else PARTS_TRIAL[first] // comm.size
    transport.parts_in_place_from = parts
    return base, parts


def wins_from(faster) -> int:
    """The least index from which every one of ``faster`` is true (len(faster): none)."""
    first = len(faster)
    while first > 0 and faster[first - 1]:
        first -= 1
    return first


def _slowest_times(comm, start, sizes, memory, calls_at) -> np.ndarray:
    """The slowest rank's seconds of each of ``calls_at(count, a, b)`` at each of
    ``sizes`` (a row each), its buffers ``a`` and ``b`` on ``memory`` (_small_pages or
    _huge_pages), the calls taking turns."""
    n, mine = comm.size, []
    for nbytes in sizes:
        count = _count(n, nbytes)
        a, b = _buffers(memory, n, count)
        mine.extend(_times(start, calls_at(count, a, b), _rounds(nbytes)))
    slowest = np.array(mine)
    comm.all_reduce(slowest, op="max")
    return slowest.reshape(len(sizes), -1)


def _with(transport, setting: str, value, call: "Timed") -> "Timed":
    """``call`` with the transport's ``setting`` at ``value``."""
    def run():
        setattr(transport, setting, value)
        call.run()
    return Timed(call.write, run)


def _small_pages(count: int) -> np.ndarray:
    return mapped(count, np.float32, huge=False)


def _huge_pages(count: int) -> np.ndarray:
    return mapped(count, np.float32, huge=True)


def _in_regions(memory) -> Callable[[int], np.ndarray]:
    """What allocates ``count`` elements in a region of ``memory`` (the transport's
    host_memory.SharedHostMemory; collective, as Communicator.empty, which the pass does not
    call: a communicator's calls weigh regions only once its user has some)."""
    return lambda count: as_array(memory.allocate(count * 4), (count,), np.float32)


class Timed(NamedTuple):
    """A timed call (``run``) and what writes its input before each time (``write``)."""
    write: Callable[[], None]
    run: Callable[[], None]


def _call(comm, collective: str, name: str, a, b, count: int) -> Timed:
    """``collective`` with algorithm ``name`` on ``count`` elements of ``a`` (and ``b``),
    its input (``a``'s first ``count``, reduce_scatter's all of ``a``) written before each
    time, as a training step writes a gradient before it reduces it: a peer then reads
    the input from its writer's cache, and a reader in place no longer finds the lines
    it read last time in its own (broadcast of 256 KiB at 2 ranks: one_copy 19 us on an
    unchanged input, 34 on a written one, where ring took 24-26 either way)."""
    inp = a if collective_of(collective).parts == "scatter" else a[:count]
    run = {
        "all_reduce": lambda: comm.all_reduce(a[:count], algorithm=name),
        "reduce": lambda: comm.reduce(a[:count], algorithm=name),
        "broadcast": lambda: comm.broadcast(a[:count], algorithm=name),
        "reduce_scatter": lambda: comm.reduce_scatter(b[:count], a, algorithm=name),
        "all_gather": lambda: comm.all_gather(b, a[:count], algorithm=name),
        "all_to_all": lambda: comm.all_to_all(b[:count], a[:count], algorithm=name),
    }[collective]
    return Timed(lambda: inp.fill(1), run)


def _starting_line(comm, transport):
    """What every timed call starts after: MPI's barrier where there is MPI, as the
    benchmark's calls start (its ranks leave with the skew real calls meet, so an algorithm
    that lets a rank go early shows it; commlib's own barrier releases them within a few
    hundred ns, which hid that: broadcast of 64 KiB at 2 ranks took `tree` at 0.64 of
    `direct`), else (torchrun) commlib's."""
    mpi = getattr(transport.world, "coll", None)  # (MpiWorld's collective communicator)
    return mpi.Barrier if mpi is not None else comm.barrier


def _affordable(comm, largest: int, before: int, seconds_before: float,
                most_calls: int) -> tuple[int, int]:
    """(bytes, calls) to time at the largest size: ``largest``, or half of it as often as
    its calls would take more than LARGEST_SIZE_SECONDS, foreseen by bytes from the
    ``seconds_before`` one of each took at ``before`` bytes (the slowest rank's: every
    rank takes the same), down to twice ``before``; and as many calls there, up to
    ``most_calls``, as fit in that time."""
    seconds = np.array([seconds_before])
    comm.all_reduce(seconds, op="max")

    def one_of_each(nbytes: int) -> float:  # seconds, foreseen by bytes
        return seconds[0] * nbytes / before
    nbytes = largest
    while nbytes > 2 * before and \
            one_of_each(nbytes) * (_rounds(nbytes) + 1) > LARGEST_SIZE_SECONDS:
        nbytes //= 2
    fit = int(LARGEST_SIZE_SECONDS / max(one_of_each(nbytes), 1e-9)) - 1  # (a warm-up)
    return nbytes, max(_rounds(nbytes), min(most_calls, fit))


def _rounds(nbytes: int) -> int:
    return max(FEWEST_CALLS, min(CALLS, CALLS * (1 << 20) // nbytes))


def _times(start, calls: list[Timed], rounds: int) -> list[float]:
    """Seconds of one of each of ``calls`` from a common start (after ``start()``), as the
    benchmark times them (``compare --fresh``): this rank's median over a few rounds in
    which every call takes its turn (``rounds`` of them), each on an input just written,
    after a warm-up."""
    for call in calls:
        call.run()
    times = np.empty((rounds, len(calls)))
    for r in range(rounds):
        for i, call in enumerate(calls):
            call.write()
            start()
            began = time.perf_counter()
            call.run()
            times[r, i] = time.perf_counter() - began
    return np.median(times, axis=0).tolist()


def _path(digest: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "commlib" / "tables" / f"{digest}.json"


def _load(digest: str, layout: dict) -> Table | None:
    path = _path(digest)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("layout") != layout:
            raise ValueError("it was measured for another machine or layout")
        return Table(data["times"], data["on_huge_pages"], data["base_pages_in_place"],
                     data["parts_in_place_from"], data["in_regions"])
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"commlib: ignoring the algorithm table {path} ({e}); measuring "
                      "again", stacklevel=2)
        return None


def _save(digest: str, layout: dict, table: Table, seconds: float) -> None:
    path = _path(digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"layout": layout, "measured_in_seconds": round(seconds, 3),
                                   "base_pages_in_place": table.base_pages_in_place,
                                   "parts_in_place_from": table.parts_in_place_from,
                                   "times": table.times,
                                   "on_huge_pages": table.on_huge_pages,
                                   "in_regions": table.in_regions}, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:  # a read-only home: the table lives in this process only
        warnings.warn(f"commlib: cannot cache the algorithm table in {path}: {e}",
                      stacklevel=2)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
