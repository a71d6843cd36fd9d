"""What each collective is, in one table: the C++ extension's (csrc/agreement.h's
kCollectives, which C++ branches on too), read once here. Every branch on what kind of
collective a call is reads a trait of this table, or a per-collective entry, never
the collective's name.

Vocabulary: a collective's *parts* say how its buffers relate: ``in_place`` (one buffer,
``t``, read and written: all_reduce, broadcast, reduce), ``scatter`` (an input of one block
per rank, an output of one block: reduce_scatter), ``gather`` (the reverse: all_gather),
``exchange`` (a part for every peer each way, of any sizes: all_to_all), ``none`` (barrier).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _C

PARTS = ("in_place", "scatter", "gather", "exchange", "none")  # agreement.h's Parts, in order


@dataclass(frozen=True)
class Collective:
    name: str
    code: int  # _C's (descriptors, the fast path)
    reduces: bool  # by an op (every rank's buffer, or the root's)
    rooted: bool  # one rank is the root
    from_root: bool  # only the root's data moves
    parts: str  # PARTS

    @property
    def in_place(self) -> bool:
        return self.parts == "in_place"

    @property
    def has_input(self) -> bool:
        """Whether it takes an input apart from its output."""
        return self.parts in ("scatter", "gather", "exchange")

    @property
    def uneven(self) -> bool:
        """Whether its parts per peer may differ in size (splits)."""
        return self.parts == "exchange"

    def input_bytes(self, primary_bytes: int, n: int) -> int:
        """Bytes of one rank's input (its only buffer, in place) when the call's primary
        buffer (csrc/call.h: a scatter's output, a gather's input) holds ``primary_bytes``
        among ``n`` ranks."""
        return primary_bytes * n if self.parts == "scatter" else primary_bytes


TABLE = {name: Collective(name, code, reduces, rooted, from_root, PARTS[parts])
         for name, code, reduces, rooted, from_root, parts in _C.COLLECTIVE_TABLE}
# the collectives a Communicator offers (barrier is a call of its own: no buffers), in the
# order commlib lists them (benchmarks, tables, messages)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
assert set(COLLECTIVES) == {n for n, c in TABLE.items() if c.parts != "none"}, \
    "collectives.COLLECTIVES lists every collective of csrc/agreement.h's kCollectives"
CODES = {name: TABLE[name].code for name in COLLECTIVES}
NAMES = {c.code: name for name, c in TABLE.items()}  # (barrier's too)
REDUCING = frozenset(name for name in COLLECTIVES if TABLE[name].reduces)
ROOTED = frozenset(name for name in COLLECTIVES if TABLE[name].rooted)


def of(name: str) -> Collective:
    """The table's row for collective ``name``; ValueError naming the known ones."""
    found = TABLE.get(name)
    if found is None:
        raise ValueError(f"unknown collective {name!r}; known: {', '.join(COLLECTIVES)}")
    return found
