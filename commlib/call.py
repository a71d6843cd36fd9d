"""A collective call, validated once: what every layer below the public collectives reads.

``make`` checks a call's arguments (ValueError/TypeError before anything is sent). The
rules that relate its buffers (sizes, dtypes, overlaps, root, avg on integers) are
csrc/call.h's, which the fast path checks too; Python adds what only it sees (the
objects' types, op names, splits). A call's *descriptor* is what the ranks must agree on
(csrc/agreement.h): collective, algorithm (its name packed into 8 bytes), count, dtype,
op, root, variant, reserved; _C.NONE where a field does not apply.
"""
from __future__ import annotations

import operator
from enum import Enum

from . import _C, settings, user_ops
from .buffers import Buffer, as_buffer
from .collectives import of as collective_of
from .dtypes import DType
from .user_ops import UserOp


class ReduceOp(str, Enum):
    """Reduction operators."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  # reduces as sum, then scaled by 1/size; floating dtypes only
    BAND = "band"  # bitwise and, or, xor: integer dtypes only
    BOR = "bor"
    BXOR = "bxor"

    @property
    def builtin(self) -> bool:
        return True  # (user-defined ops are user_ops.UserOp)

    @property
    def bitwise(self) -> bool:
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

    @property
    def host_only(self) -> bool:
        """Whether the GPU kernels lack it (calls on GPU arrays are staged through the host)."""
        return self.bitwise

    @property
    def code(self) -> int:
        return _C.OPS[self.value]

    @classmethod
    def parse(cls, op):
        """Accept a ReduceOp, its name (any case), or a user-defined op (``define``)."""
        if isinstance(op, UserOp):
            return op
        parsed = op if isinstance(op, cls) else _BY_NAME.get(str(op).lower())
        if parsed is None:
            raise ValueError(f"unknown reduce op {op!r}; valid: "
                             f"{', '.join(o.value for o in cls)}, or an op made by "
                             f"ReduceOp.define")
        return parsed

    @staticmethod
    def define(fn, dtype="float32", name: str | None = None) -> UserOp:
        """A reduce op from a scalar function ``fn(a, b)``, compiled by numba for ``dtype``
        (a name or several): see commlib/user_ops.py."""
        return user_ops.define(fn, dtype, name)


_BY_NAME = {o.value: o for o in ReduceOp}
NONE = _C.NONE


class Call:
    """One rank's validated collective call: ``out`` (or the only buffer), ``inp`` (or None),
    ``count`` (the primary count: csrc/call.h), all_to_all's ``splits`` (input, output), the
    ``device`` array (None: host memory), the ``scale`` an average applies here (or None)."""

    __slots__ = ("collective", "out", "inp", "count", "dtype", "op", "op_code", "root",
                 "splits", "device", "scale")

    def __init__(self, collective: str, out: Buffer, inp: Buffer | None, count: int,
                 dtype: DType, op: ReduceOp | None, root: int | None, splits: tuple | None,
                 scale: float | None):
        self.collective, self.out, self.inp, self.count = collective, out, inp, count
        self.dtype, self.op, self.root, self.splits, self.scale = dtype, op, root, splits, scale
        self.device = out.device
        # the op as C++ takes it: SUM for collectives that do not reduce
        self.op_code = (op or ReduceOp.SUM).code

    @property
    def bufs(self) -> dict:
        """The buffers by the names schedules use: "out", and "in" where there is one."""
        return {"out": self.out} if self.inp is None else {"out": self.out, "in": self.inp}

    @property
    def nbytes(self) -> int:
        """The primary count's bytes: what algorithms are chosen by."""
        return self.count * self.dtype.itemsize

    @property
    def params(self) -> tuple:
        """What besides collective, count and itemsize fixes a plan: root, splits."""
        if self.splits is not None:
            return (("input_splits", self.splits[0]), ("output_splits", self.splits[1]))
        return (("root", self.root),) if self.root is not None else ()

    def descriptor(self, algorithm: str) -> list:
        return descriptor(self.collective, algorithm, self.count, self.dtype.code,
                          self.op_code, self.root)

    def split_bytes(self) -> tuple[list, list] | None:
        """all_to_all's bytes to and from each peer, which the ranks check as a matrix."""
        if self.splits is None:
            return None
        return tuple([s * self.dtype.itemsize for s in side] for side in self.splits)

    def on(self, out: Buffer, inp: Buffer | None = None) -> "Call":
        """The same call on other buffers (host twins of device memory, a stage's part)."""
        return Call(self.collective, out, inp, self.count, self.dtype, self.op, self.root,
                    self.splits, self.scale)


def make(collective: str, size: int, rank: int, out, inp=None, op=None, root=None,
         input_splits=None, output_splits=None) -> Call:
    """The validated call; raises ValueError/TypeError naming what is wrong. Collectives of
    one tensor take it as ``out`` (named "t" in messages)."""
    kind = collective_of(collective)
    out_b = as_buffer(out, "t" if kind.in_place else "output")
    in_b = as_buffer(inp, "input", writable=False) if kind.has_input else None
    if in_b is not None and (out_b.device is not None or in_b.device is not None):
        _same_device(out_b, in_b)
    reduce_op = ReduceOp.parse(op) if kind.reduces else None
    if kind.rooted:
        check_rank(root, "root")
    else:
        root = None
    count, scale = _C.check_call(
        kind.code, size, rank, out_b.ptr, out_b.numel, out_b.dtype.code,
        *((in_b.ptr, in_b.numel, in_b.dtype.code) if in_b is not None else (0, 0, -1)),
        reduce_op.code if reduce_op else NONE, NONE if root is None else root)
    splits = None
    if kind.uneven:
        splits = (_splits(size, input_splits, in_b.numel, "input_splits"),
                  _splits(size, output_splits, out_b.numel, "output_splits"))
    return Call(collective, out_b, in_b, count, out_b.dtype, reduce_op, root, splits,
                scale or None)


def check_rank(value, what: str, size: int | None = None) -> int:
    """An int rank, inside ``size`` where given (a root's range is csrc/call.h's)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if size is not None and not 0 <= value < size:
        raise ValueError(f"{what}={value} is outside the communicator (size {size})")
    return value


def _same_device(out: Buffer, inp: Buffer | None) -> None:
    where = {name: "host" if b.device is None else f"cuda:{b.device.device}"
             for name, b in (("out", out), ("in", inp)) if b is not None}
    if len(set(where.values())) > 1:
        raise ValueError(f"buffers on different devices ({where}); put them all on one GPU")


def _splits(size: int, splits, total: int, name: str) -> tuple:
    if splits is None:
        if total % size:
            raise ValueError(f"all_to_all: {name.removesuffix('_splits')} has {total} elements, "
                             f"not divisible by size {size}; pass {name} to split it unevenly")
        return (total // size,) * size
    if hasattr(splits, "tolist"):  # numpy arrays, tensors
        splits = splits.tolist()
    try:
        splits = tuple(operator.index(s) for s in splits)
    except TypeError:
        raise TypeError(f"all_to_all: {name} must be integers, got {splits!r}") from None
    if len(splits) != size:
        raise ValueError(f"all_to_all: {name} has {len(splits)} entries, expected one per rank "
                         f"({size})")
    if any(s < 0 for s in splits):
        raise ValueError(f"all_to_all: {name} must be non-negative ints, got {list(splits)}")
    if sum(splits) != total:
        raise ValueError(f"all_to_all: {name} sum to {sum(splits)} but the tensor has "
                         f"{total} elements")
    return splits


def pack_name(name: str) -> int:
    """An algorithm's name as csrc/agreement.h packs it: up to 8 ASCII bytes, little-endian."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little", signed=True)


def descriptor(collective: str, algorithm: str, count: int, dtype_code: int, op_code: int,
               root) -> list:
    kind = collective_of(collective)
    return [kind.code, pack_name(algorithm), NONE if kind.uneven else count, dtype_code,
            op_code if kind.reduces else NONE, root if kind.rooted else NONE, 0, 0]


def invalid_descriptor(collective: str) -> list:
    """What a rank whose arguments failed validation publishes instead (agreement.h)."""
    return [collective_of(collective).code, NONE, NONE, NONE, NONE, NONE, _C.INVALID, 0]


def default_timeout() -> float:
    """COMMLIB_TIMEOUT: seconds a collective may wait for its peers (0: no limit)."""
    return settings.get("COMMLIB_TIMEOUT")


def check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 (0: none), got {timeout!r}")
    return float(timeout)
