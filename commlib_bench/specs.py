"""Each collective as a small spec, nccl-tests conventions.

``size`` is the bytes of the larger per-rank buffer and ``count`` its elements: the tensor
for all_reduce/broadcast/reduce, the input of reduce_scatter, the output of all_gather, the
input (= output) of all_to_all. busbw = algbw * factor(n), comparable to the hardware's
bandwidth whatever the collective.

The bound on busbw where ranks share one host's memory: ``traffic(n)`` is the least a
rank must read plus write, per byte of ``size``, when the ranks share the work and each
byte is read and written once where it must be (a memcpy moves 2 per byte copied):
all_to_all and all_gather write ``size`` of output and read it from the inputs (2); a
broadcast's receivers copy ``size`` (2); a reduce_scatter reads its block from every
input and writes it (1 + 1/n); an all_reduce reduce-scatters, then copies the n - 1
blocks it lacks (3 - 1/n), as does a reduce's root. At memcpy's bandwidth M (every rank
copying at once) that takes traffic * size / (2 M), so busbw <= 2 M factor(n) / traffic(n).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from commlib.collectives import Collective, of as collective_of

from .harness import exact_values

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max", "avg"]
def itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


_REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "avg": np.add}


def _reduced(inputs, op: str, n: int) -> np.ndarray:
    """Every rank's input (``inputs(r)``) reduced by ``op`` in rank order."""
    acc = functools.reduce(_REDUCE[op], (inputs(r) for r in range(n)))
    return acc / n if op == "avg" else acc


def _block(x: np.ndarray, rank: int, n: int) -> np.ndarray:
    per = len(x) // n
    return x[rank * per:(rank + 1) * per]


# what rank ``rank`` ends with, from every rank's input (``inputs(r)``, float64): one entry
# per collective
_RESULTS = {
    "all_reduce": lambda inputs, rank, root, op, n: _reduced(inputs, op, n),
    "reduce": lambda inputs, rank, root, op, n:
        _reduced(inputs, op, n) if rank == root else inputs(rank),
    "reduce_scatter": lambda inputs, rank, root, op, n: _block(_reduced(inputs, op, n), rank, n),
    "all_gather": lambda inputs, rank, root, op, n: np.concatenate([inputs(r) for r in range(n)]),
    "broadcast": lambda inputs, rank, root, op, n: inputs(root),
    "all_to_all": lambda inputs, rank, root, op, n:
        np.concatenate([_block(inputs(r), rank, n) for r in range(n)]),
}


@dataclass(frozen=True)
class Spec:
    name: str
    busbw_factor: Callable[[int], float]
    traffic: Callable[[int], float] = lambda n: 2.0  # (see the module's docstring)

    @property
    def kind(self) -> Collective:
        """What the collective is (commlib.collectives: reduces, rooted, its parts)."""
        return collective_of(self.name)

    @property
    def reduces(self) -> bool:
        return self.kind.reduces

    @property
    def rooted(self) -> bool:
        return self.kind.rooted

    @property
    def blocked(self) -> bool:
        """Whether count splits into n blocks (rounded down to a multiple of n)."""
        return not self.kind.in_place

    def bound(self, n: int, memcpy_gbs: float) -> float:
        """busbw if every rank moved its least traffic at ``memcpy_gbs`` (bytes copied/s)."""
        return 2 * memcpy_gbs * self.busbw_factor(n) / self.traffic(n)

    def buffer_counts(self, n: int, count: int) -> tuple[int, int]:
        """(input elements, output elements) per rank; equal means one in-place buffer."""
        return {"scatter": (count, count // n), "gather": (count // n, count)
                }.get(self.kind.parts, (count, count))

    def expected(self, n: int, rank: int, count: int, op: str, root: int, unsigned: bool):
        """(input data, expected output) of this rank, float64."""
        n_in, _ = self.buffer_counts(n, count)
        inputs = lambda r: exact_values(n_in, r, op, n, unsigned)  # noqa: E731
        return inputs(rank), _RESULTS[self.name](inputs, rank, root, op, n)


SPECS = {s.name: s for s in (
    Spec("all_reduce", lambda n: 2 * (n - 1) / n, traffic=lambda n: 3 - 1 / n),
    Spec("reduce_scatter", lambda n: (n - 1) / n, traffic=lambda n: 1 + 1 / n),
    Spec("all_gather", lambda n: (n - 1) / n),
    Spec("all_to_all", lambda n: (n - 1) / n),
    Spec("broadcast", lambda n: 1.0),
    Spec("reduce", lambda n: 1.0, traffic=lambda n: 3 - 1 / n),
)}


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, op: str | None) -> int:
    """Elements that differ: exactly, or beyond the dtype's rounding for avg."""
    if got.shape != want.shape:
        return max(got.size, want.size)
    if op == "avg":
        tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
        return int((~np.isclose(got, want, rtol=tol, atol=tol)).sum())
    return int((got != want).sum())
