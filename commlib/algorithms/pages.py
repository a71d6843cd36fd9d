"""pages: auto's choice by the kind of memory a call's buffers lie on.

The measured table (commlib/tuning.py) times one_copy's collectives on 4 KiB pages and on
huge ones, where their fastest often differ: one_copy reads huge pages in place at a
meeting's cost, while on 4 KiB pages the kernel pins every page it reads and a schedule's
copies may win. Where the two differ at a call's size, auto takes ``by_pages(huge, base)``:
each rank looks at the pages of its buffer the peers read (csrc/shm_one_copy.cpp's
mostly_huge), the ranks agree in one all_reduce of a flag, and all run ``huge`` only
where every rank's buffers lie on huge pages, else ``base``. Where ``huge`` is one_copy,
whose own meeting already tells whether every rank's memory is read in place, no flag is
needed: one_copy stages by ``base`` itself (``Algorithm.otherwise``), in C++ and on the fast
path (the flag and the general path cost 60-200 us a 4 MiB broadcast on a 2-core AMD EPYC,
where one_copy took 220-500).

Memory every rank maps (Communicator.empty's regions) is the third kind: one_copy reads it
through its own mapping, with no system call, and beat MPI 1.2-4.6x at 2 ranks where auto,
choosing by 4 KiB pages, ran a schedule at 0.57-0.65 of it. Once a communicator has handed
out such memory, auto routes a call through ``in_regions(one_copy, base)`` where the table
timed one_copy in regions faster than ``base`` on 4 KiB pages: one_copy's meeting, reading
in place only where every rank's buffer lies in a region, else staging by ``base`` (a
meeting more than ``base``: 1.3-3.5 us at 2 ranks). Not an algorithm to ask for by name:
auto's alone.
"""
import mmap
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import _C
from ..call import make
from ..collectives import of as collective_of
from .registry import Algorithm


# The least gain on huge pages (the huge-page choice's time against the other's there)
# that pays for deciding per call by a flag: its agreement and the general path it takes
# (the C++ fast path runs one algorithm): 50-120 us a call on a 2-core AMD EPYC, where huge
# pages gained 1.3-1.6x at 4-16 MiB and a few percent (noise) below. Where one_copy's own
# meeting decides, any gain pays.
WORTH = 1.25


def worth_deciding_by_pages(table, collective: str, n: int, nbytes: int | None,
                            base: Algorithm, huge: Algorithm) -> bool:
    """Whether a call of ``nbytes`` (None: any size) among ``n`` ranks should choose by its
    memory: its buffer can fill a huge page, and ``huge`` gains there WORTH, or anything
    where it decides by its own meeting (one_copy_decides)."""
    least = 1.0 if one_copy_decides(huge, base, collective in table.base_pages_in_place) \
        else WORTH
    return fills_a_huge_page(collective, n, nbytes) and \
        table.gain_on_huge_pages(collective, nbytes, base.name, huge.name) > least


def fills_a_huge_page(collective: str, n: int, nbytes: int | None) -> bool:
    """Whether the buffer the peers read in a call of ``nbytes`` primary bytes among ``n``
    ranks (reduce_scatter's input holds n blocks) can fill a huge page (None: any size)."""
    return nbytes is None or \
        collective_of(collective).input_bytes(nbytes, n) >= huge_page_bytes()


def one_copy_decides(huge: Algorithm, base: Algorithm, base_pages_in_place: bool) -> bool:
    """Whether ``huge`` is one_copy and stages by ``base`` itself where a rank's buffer lies
    on 4 KiB pages (its first meeting tells every rank: no flag, and the fast path)."""
    return huge.name == "one_copy" and not base_pages_in_place and stages_by(base)


def stages_by(base: Algorithm) -> bool:
    """Whether one_copy can stage a call by ``base``: a schedule, or direct."""
    return base.build is not None or base.name == "direct"


def worth_reading_regions(table, collective: str, nbytes: int | None, base: Algorithm) -> bool:
    """Whether a call of ``nbytes`` (None: any size) that auto runs by ``base`` should go
    through one_copy's meeting where its memory may lie in regions: one_copy can stage it by
    ``base``, and was timed faster in regions than ``base`` on 4 KiB pages."""
    return base.name != "one_copy" and stages_by(base) and \
        table.gain_in_regions(collective, nbytes, base.name) > 1.0


@lru_cache(maxsize=256)
def in_regions(one_copy: Algorithm, base: Algorithm) -> Algorithm:
    """An entry that runs ``one_copy`` where every rank's buffer lies in a region, else
    ``base`` (its one_copy meeting tells every rank alike)."""
    otherwise = base if base.build is not None else None  # (None: as direct does)

    def run(transport, call):
        transport.one_copy(call, otherwise and transport.plan(otherwise, call),
                           only_regions=True)
    return replace(one_copy, run=run, otherwise=otherwise, only_regions=True,
                   user_ops=base.user_ops and one_copy.user_ops,
                   rank_order=base.rank_order and one_copy.rank_order)


@lru_cache(maxsize=1)
def huge_page_bytes() -> int:
    """The size of a transparent huge page here (2 MiB where the kernel does not say)."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def mapped(count: int, dtype, huge: bool) -> np.ndarray:
    """``count`` elements of private memory on huge pages (``huge``: where the kernel gives
    them, THP "madvise" or "always") or on 4 KiB pages."""
    itemsize = np.dtype(dtype).itemsize
    page = huge_page_bytes() if huge else 0
    raw = mmap.mmap(-1, max(1, -(-count * itemsize // page) * page + page if huge
                            else count * itemsize),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE"
    if hasattr(mmap, advice):
        raw.madvise(getattr(mmap, advice))
    start = -np.frombuffer(raw, np.uint8, 1).ctypes.data % page if huge else 0
    return np.frombuffer(raw, dtype, count, offset=start)  # (from the first whole page)


def on_huge_pages(call, rank: int) -> bool:
    """Whether the buffer of this rank that its peers read (the input; a broadcast's at the
    root) lies mostly on huge pages: an output not yet written has no pages to tell by."""
    read = call.inp if call.inp is not None else call.out
    if call.root is not None and call.root != rank:
        return True  # (nobody reads it)
    return read.numel == 0 or _C.mostly_huge(read.ptr, read.numel * read.dtype.itemsize)


def chosen(transport, call, huge: Algorithm, base: Algorithm) -> Algorithm:
    """``huge`` where every rank's buffers lie on huge pages, else ``base`` (collective)."""
    flag = np.array([int(on_huge_pages(call, transport.rank))], np.int32)
    transport.execute(make("all_reduce", transport.size, transport.rank, flag, op="min"),
                      "direct")
    return huge if flag[0] else base


@lru_cache(maxsize=256)
def by_pages(huge: Algorithm, base: Algorithm, base_pages_in_place: bool = False) -> Algorithm:
    """An entry that runs ``huge`` or ``base`` by the call's memory, agreed by all ranks
    (``base_pages_in_place``: one_copy reads this collective's 4 KiB pages in place too)."""
    if one_copy_decides(huge, base, base_pages_in_place):
        flags = {"user_ops": base.user_ops and huge.user_ops,
                 "rank_order": base.rank_order and huge.rank_order}
        if base.build is None:
            return replace(huge, **flags)  # (it stages as direct does)

        def one_copy_else_base(transport, call):
            transport.one_copy(call, transport.plan(base, call))
        return replace(huge, run=one_copy_else_base, otherwise=base, **flags)
    def run(transport, call):
        algo, plan, _ = transport.choice(call, chosen(transport, call, huge, base).name)
        transport.agree_call(call, algo)
        if plan is None:
            algo.run(transport, call)
        else:
            transport.run_plan(plan, call)
    return Algorithm("pages", base.collective, base.cost, run=run, needs=base.needs,
                     agrees=True, user_ops=base.user_ops and huge.user_ops,
                     rank_order=base.rank_order and huge.rank_order)
