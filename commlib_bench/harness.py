"""The one harness every benchmark uses: sizes, timing, checking data, output.

Timing: each iteration is timed on every rank after a barrier; an iteration's time is the
max over ranks, and a benchmark reports the median over iterations.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '64K', '16M', '1G' -> bytes."""
    text = str(text).strip()
    try:
        if text[-1:].upper() in _UNITS:
            return int(text[:-1]) * _UNITS[text[-1].upper()]
        return int(text)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use bytes, or K/M/G suffixes)") from None


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 0 or hi < lo or factor < 2:
        raise ValueError(f"need 0 <= min ({lo}) <= max ({hi}) and factor ({factor}) >= 2")
    out, s = ([0] if lo == 0 else []), max(lo, 1)
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def use_local_gpu(world: MPI.Comm, what: str) -> int:
    """Make this rank's current CUDA device one of its host's GPUs (a host's ranks spread
    over them) and return it; SystemExit naming ``what`` where torch sees none."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA device (torch.cuda.is_available() is False)")
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    device = local.rank % torch.cuda.device_count()
    local.Free()
    torch.cuda.set_device(device)
    return device


def iteration_times(world: MPI.Comm, fn, iters: int, warmup: int = 0,
                    before=None) -> np.ndarray:
    """Per-iteration seconds, each the max over ranks; ``before()``, where given, runs
    ahead of each iteration, untimed."""
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    for i in range(iters):
        if before is not None:
            before()
        world.Barrier()
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def exact_values(count: int, rank: int, op: str | None, n: int, unsigned: bool) -> np.ndarray:
    """Integer-valued data whose reduction over n ranks is exact in every dtype (float64)."""
    i = np.arange(count, dtype=np.int64) * 7 + rank * 5
    if op == "prod":
        table = [1.0, 1.0, 2.0] if unsigned else [-1.0, 1.0, 2.0]
        if n > 6:  # 2**n would leave the exact range of the small types
            table = [1.0, 1.0, 1.0] if unsigned else [-1.0, 1.0, 1.0]
        return np.asarray(table)[i % 3]
    span = max(1, 120 // max(n, 1))  # sums stay within int8
    return (i % span).astype(np.float64) - (0 if unsigned else span // 2)


class Progress:
    """A one-line progress bar on rank 0's terminal (silent when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()

    def step(self, label: str = "") -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"{label:<30}")
            if self.done == self.total:
                sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


def print_table(header: list[str], rows: list[list], file=None) -> None:
    """Right-aligned columns, '#'-prefixed header (nccl-tests style)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    out = file or sys.stdout
    print("#" + " ".join(h.rjust(w) for h, w in zip(header, widths)), file=out)
    for r in cells:
        print(" " + " ".join(c.rjust(w) for c, w in zip(r, widths)), file=out)
    out.flush()


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2e}"
    return str(v)


def write_json(path: str, command: str, world: MPI.Comm, rows: list[dict], **meta) -> None:
    doc = {"command": command, "ranks": world.size, "mpi": MPI.Get_library_version().split("\n")[0],
           **meta, "results": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
