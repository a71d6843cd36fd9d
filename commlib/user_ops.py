"""User-defined reduce ops: a scalar Python function ``fn(a, b)``, compiled by numba into two
native block functions per dtype that the C++ kernels call without the GIL wherever a
collective reduces (csrc/user_ops.h).

    maxabs = commlib.ReduceOp.define(lambda a, b: max(abs(a), abs(b)), "float32")
    comm.all_reduce(x, op=maxabs)

``fn`` must be commutative and associative (the algorithms reorder and regroup operands), and
be what numba's nopython mode compiles. Its result is cast to the dtype. float16 and bfloat16
reduce through the float32 compilation, on float32 blocks. An op's code is derived from its
definition (name, dtypes, the function's bytecode and constants), so ranks that define the
same op agree on it, and the agreement check names an op that differs. GPU arrays are
staged through host memory for it. numba is an optional extra: ``pip install commlib[userops]``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import _C
from .dtypes import DTYPES, NAMES

_COMPILED = ("float32", "float64", "int8", "uint8", "int32", "int64")
_THROUGH_FLOAT32 = ("float16", "bfloat16")


@dataclass(frozen=True, eq=False)
class UserOp:
    """A reduce op made by ``define``; pass it as any collective's ``op``."""
    name: str
    code: int
    dtypes: tuple
    fn: object
    kernels: tuple  # the compiled functions, kept alive as long as the op

    builtin = False
    bitwise = False
    host_only = True  # the GPU kernels do not have it: GPU arrays are staged through the host

    @property
    def value(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<commlib user op {self.name!r} for {', '.join(self.dtypes)}>"


_defined: dict[int, UserOp] = {}  # by code: what C++ calls stays alive with its op
_hooks: list = []  # called with each new op: what the layers above asked (fast_path's)


def on_define(hook) -> None:
    """Call ``hook(op)`` for every op defined so far and each one defined from now on (the
    layers above learn of ops so, without this module importing them)."""
    _hooks.append(hook)
    for op in _defined.values():
        hook(op)


def define(fn, dtype="float32", name: str | None = None) -> UserOp:
    """The reduce op ``fn(a, b)`` (commutative, associative) for ``dtype``: one dtype name or
    several ("float32", ("float32", "bfloat16"), ...)."""
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"ReduceOp.define takes a Python function fn(a, b), got {fn!r}")
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    unknown = [d for d in dtypes if d not in DTYPES]
    if not dtypes or unknown:
        raise ValueError(f"ReduceOp.define: unknown dtype {unknown or dtype!r}; valid: {NAMES}")
    dtypes = tuple(sorted(set(dtypes), key=lambda d: DTYPES[d].code))
    name = name or fn.__name__
    code = _code(fn, name, dtypes)
    if code in _defined:
        return _defined[code]
    by_dtype = [(0, 0)] * len(DTYPES)
    compiled: dict = {}  # compiled dtype -> (apart, into): 16-bit floats share float32's
    for d in dtypes:
        through = "float32" if d in _THROUGH_FLOAT32 else d
        if through not in compiled:
            compiled[through] = _compile(fn, through, name)
        apart, into = compiled[through]
        by_dtype[DTYPES[d].code] = (apart.address, into.address)
    kernels = [k for pair in compiled.values() for k in pair]
    _C.define_user_op(code, name, by_dtype)
    op = _defined[code] = UserOp(name, code, dtypes, fn, tuple(kernels))
    for hook in _hooks:
        hook(op)
    return op


def _code(fn, name: str, dtypes: tuple) -> int:
    """The same on every rank for the same definition."""
    code = fn.__code__
    what = repr((name, dtypes, code.co_code, code.co_consts, code.co_names)).encode()
    digest = int.from_bytes(hashlib.sha256(what).digest()[:8], "little")
    return _C.FIRST_USER_OP + digest % (_C.LAST_USER_OP - _C.FIRST_USER_OP + 1)


def _compile(fn, dtype: str, name: str):
    """(apart, into): numba cfuncs over blocks of ``dtype`` (csrc/user_ops.h)."""
    try:
        import numba
        from numba import types
    except ImportError:
        raise ImportError("ReduceOp.define compiles with numba, which is not installed; "
                          "pip install 'commlib[userops]' (or numba)") from None
    t = getattr(types, dtype)
    p = types.CPointer(t)
    try:
        # error_model="numpy": a division by zero gives inf/nan as numpy's, never an exception
        # (which a function called from C++ without the GIL could not raise)
        scalar = numba.njit(t(t, t), error_model="numpy")(fn)

        @numba.cfunc(types.void(p, p, p, types.int64), error_model="numpy")
        def apart(dst, a, b, n):
            for i in range(n):
                dst[i] = scalar(a[i], b[i])

        @numba.cfunc(types.void(p, p, types.int64), error_model="numpy")
        def into(dst, b, n):
            for i in range(n):
                dst[i] = scalar(dst[i], b[i])
    except numba.core.errors.NumbaError as e:
        first = str(e).strip().splitlines()[0]
        raise TypeError(f"ReduceOp.define: numba cannot compile {name!r} for {dtype}: "
                        f"{first}") from None
    return apart, into
