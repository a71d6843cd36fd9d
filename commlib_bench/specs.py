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

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .harness import exact_values

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max", "avg"]
def itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


_REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "avg": np.add}


@dataclass(frozen=True)
class Spec:
    name: str
    busbw_factor: Callable[[int], float]
    reduces: bool = False
    rooted: bool = False
    blocked: bool = False  # count splits into n blocks (rounded down to a multiple of n)
    traffic: Callable[[int], float] = lambda n: 2.0  # (see the module's docstring)

    def bound(self, n: int, memcpy_gbs: float) -> float:
        """busbw if every rank moved its least traffic at ``memcpy_gbs`` (bytes copied/s)."""
        return 2 * memcpy_gbs * self.busbw_factor(n) / self.traffic(n)

    def buffer_counts(self, n: int, count: int) -> tuple[int, int]:
        """(input elements, output elements) per rank; equal means one in-place buffer."""
        return {"reduce_scatter": (count, count // n), "all_gather": (count // n, count)
                }.get(self.name, (count, count))

    def expected(self, n: int, rank: int, count: int, op: str, root: int, unsigned: bool):
        """(input data, expected output) of this rank, float64."""
        n_in, _ = self.buffer_counts(n, count)
        mine = exact_values(n_in, rank, op, n, unsigned)
        every = lambda c: [exact_values(c, r, op, n, unsigned) for r in range(n)]  # noqa: E731
        if self.name in ("all_reduce", "reduce", "reduce_scatter"):
            total = every(n_in)
            acc = total[0]
            for x in total[1:]:
                acc = _REDUCE[op](acc, x)
            if op == "avg":
                acc = acc / n
            if self.name == "reduce_scatter":
                block = n_in // n
                return mine, acc[rank * block:(rank + 1) * block]
            return mine, (acc if self.name == "all_reduce" or rank == root else mine)
        if self.name == "all_gather":
            return mine, np.concatenate(every(n_in))
        if self.name == "broadcast":
            return mine, exact_values(n_in, root, op, n, unsigned)
        if self.name == "all_to_all":
            per = n_in // n
            return mine, np.concatenate([x[rank * per:(rank + 1) * per] for x in every(n_in)])
        raise ValueError(self.name)


SPECS = {s.name: s for s in (
    Spec("all_reduce", lambda n: 2 * (n - 1) / n, reduces=True, traffic=lambda n: 3 - 1 / n),
    Spec("reduce_scatter", lambda n: (n - 1) / n, reduces=True, blocked=True,
         traffic=lambda n: 1 + 1 / n),
    Spec("all_gather", lambda n: (n - 1) / n, blocked=True),
    Spec("all_to_all", lambda n: (n - 1) / n, blocked=True),
    Spec("broadcast", lambda n: 1.0, rooted=True),
    Spec("reduce", lambda n: 1.0, reduces=True, rooted=True, traffic=lambda n: 3 - 1 / n),
)}


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, op: str | None) -> int:
    """Elements that differ: exactly, or beyond the dtype's rounding for avg."""
    if got.shape != want.shape:
        return max(got.size, want.size)
    if op == "avg":
        tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
        return int((~np.isclose(got, want, rtol=tol, atol=tol)).sum())
    return int((got != want).sum())
