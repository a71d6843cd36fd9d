"""The algorithm table: what the tuning pass (commlib/tuning.py) measured, per kind of
memory, and what it says of a call: the fastest algorithm at a size (interpolated in log
size between measured ones; beyond the largest, time grows with the bytes), and how much
one kind of memory gains over another (commlib/algorithms/pages.py decides by that).
"""
from __future__ import annotations

import math

from .collectives import COLLECTIVES

# The kinds of memory a table's times were measured on: 4 KiB pages (every algorithm),
# huge pages (ON_HUGE_PAGES_TOO's) and regions every rank maps (one_copy alone: the others
# copy through slots or staging wherever a buffer lies)
MEMORIES = ("base", "huge", "regions")


class Table:
    """Measured seconds per (collective, algorithm) at SIZES' primary bytes: ``times`` on
    4 KiB pages, ``on_huge_pages`` (ON_HUGE_PAGES_TOO's collectives) on huge ones,
    ``in_regions`` (one_copy's) in memory every rank maps; and how the transport reads in
    place, as the times were measured: the collectives that read buffers on 4 KiB pages
    so too (``base_pages_in_place``), and from what bytes of a rank's largest part
    direct's all_to_all reads its parts in place (``parts_in_place_from``; -1: where they
    take several staging pieces)."""

    def __init__(self, times: dict, on_huge_pages: dict | None = None,
                 base_pages_in_place=(), parts_in_place_from: int = -1,
                 in_regions: dict | None = None):
        self.times = times  # collective -> algorithm -> [[nbytes, seconds], ...]
        self.on_huge_pages = on_huge_pages or {}
        self.base_pages_in_place = sorted(base_pages_in_place)
        self.parts_in_place_from = parts_in_place_from
        self.in_regions = in_regions or {}

    def parts(self) -> tuple:
        return (self.times, self.on_huge_pages, self.base_pages_in_place,
                self.parts_in_place_from, self.in_regions)

    def of(self, memory: str) -> dict:
        """The times measured on ``memory`` (one of MEMORIES)."""
        return {"base": self.times, "huge": self.on_huge_pages,
                "regions": self.in_regions}[memory]

    def put(self, keys, seconds, keep_least: bool = False) -> None:
        """Set each key's time (key: memory, collective, name, bytes), the points kept in
        order of bytes; ``keep_least``: where there was one, the lesser of the two."""
        for (memory, collective, name, nbytes), t in zip(keys, seconds):
            points = self.of(memory).setdefault(collective, {}).setdefault(name, [])
            old = next((p for p in points if p[0] == nbytes), None)
            if old is None:
                points.append([nbytes, t])
                points.sort()
            else:
                old[1] = min(old[1], t) if keep_least else t

    def at(self, key) -> float:
        """The time measured for ``key`` (as ``put`` takes it)."""
        memory, collective, name, nbytes = key
        return next(t for b, t in self.of(memory)[collective][name] if b == nbytes)

    def measured(self, comm) -> bool:
        """Whether every algorithm ``comm`` runs was measured here."""
        return all(set(comm.algorithms(c)) <= set(self.times.get(c, ())) for c in COLLECTIVES)

    def sizes(self) -> list[int]:

        """The bytes measured, on 4 KiB pages, for any collective."""
        return sorted({b for algos in self.times.values() for points in algos.values()
                       for b, _ in points})

    @staticmethod
    def rank_0s(world, table: "Table | None") -> "Table | None":
        """Rank 0's ``table`` (None where rank 0 has none), on every rank of ``world``
        (collective), so that no two ranks choose differently."""
        parts = world.allgather(table and table.parts())[0]
        return Table(*parts) if parts else None

    def fastest(self, collective: str, nbytes: int | None, names,
                memory: str = "base") -> str | None:
        """The algorithm among ``names`` measured on ``memory`` (MEMORIES) with the least
        loss, the log of its time over the fastest's, at ``nbytes`` (interpolated) or (None:
        a choice that may not depend on the size) summed over the measured sizes; None
        where none of them was measured so."""
        measured = self.of(memory).get(collective, {})
        names = [n for n in names if n in measured]
        if not names:
            return None
        loss = dict.fromkeys(names, 0.0)
        sizes = [nbytes] if nbytes is not None else \
            sorted({b for n in names for b, _ in measured[n]})
        for size in sizes:
            at = {n: self.seconds(measured[n], size) for n in names}
            best = min(at.values())
            for n in names:
                loss[n] += math.log(at[n] / best)
        return min((loss[n], n) for n in names)[1]

    def gain_on_huge_pages(self, collective: str, nbytes: int | None, base: str,
                           huge: str) -> float:
        """How many times faster ``huge`` ran than ``base`` on huge pages at ``nbytes``
        (None: the geometric mean over the measured sizes)."""
        measured = self.on_huge_pages[collective]
        return self.gain(measured[base], measured[huge], nbytes)

    def gain_in_regions(self, collective: str, nbytes: int | None, base: str) -> float:
        """How many times faster one_copy ran in regions than ``base`` on 4 KiB pages at
        ``nbytes`` (None: the geometric mean over the sizes both were measured at); 0 where
        they were not."""
        regions = self.in_regions.get(collective, {}).get("one_copy")
        pages = self.times.get(collective, {}).get(base)
        return self.gain(pages, regions, nbytes) if regions and pages else 0.0

    @classmethod
    def gain(cls, slower: list, faster: list, nbytes: int | None) -> float:
        """``slower``'s time over ``faster``'s (points as ``seconds`` takes them) at
        ``nbytes``, or (None) their geometric mean over the sizes both hold; 0 where none."""
        sizes = [nbytes] if nbytes is not None else \
            sorted({b for b, _ in slower} & {b for b, _ in faster})
        logs = [math.log(cls.seconds(slower, b) / cls.seconds(faster, b)) for b in sizes]
        return math.exp(sum(logs) / len(logs)) if logs else 0.0

    @staticmethod
    def seconds(points: list, nbytes: int) -> float:
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                w = math.log(nbytes / b0) / math.log(b1 / b0)
                return t0 + w * (t1 - t0)
        b, t = points[-1]
        return t * nbytes / b
