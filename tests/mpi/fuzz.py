"""Property-based fuzzing (hypothesis) of the public collectives, under mpiexec.

Every example is one call of all_reduce, reduce_scatter, all_gather, all_to_all, broadcast
or reduce with drawn dtypes, containers, shapes, strides, placements (aliasing, misaligned
and adjacent buffers), ops, roots, algorithms, all_to_all splits, communicators (the world,
a dup, halves, a head/rest split, a freed one) and call styles (method or function, sync or
async). The properties, checked on every rank:

- the call either returns a correct result (bitwise, except avg: within the dtype's
  rounding), or raises ValueError/TypeError (CommError for a freed communicator) of a type
  one of the example's defects calls for, on every rank of the communicator;
- an error leaves every buffer untouched (it was raised before anything was sent), and a
  result changes the output's bytes only: each buffer lives in one arena of random bytes,
  checked byte for byte afterwards (out-of-bounds writes, inputs written to);
- what the call returns is the caller's tensor (or a Work holding it).

Rank 0 runs hypothesis (a fixed seed per world size and no database: the same examples
on every run; shrinking on a failure) and broadcasts each example; every rank runs it on its
own data, then all ranks exchange verdicts over mpi4py, so they never diverge. The examples
know nothing of the communicator's size: each rank derives its arguments from (example,
size, rank), and computes every rank's expected outcome. An example that is valid on some
ranks of its communicator and an error on others is not run but counted as "excluded":
commlib validates locally, so the valid ranks would enter the collective alone and hang
(the rank-dependent overlap rules of reduce_scatter/all_gather's in-place form, and
all_to_all's overlap test, which empty buffers pass on the ranks that have them).

Usage: mpiexec -n N python tests/mpi/fuzz.py [--examples K] [--seed S] [--verbose]
       mpiexec -n N python tests/mpi/fuzz.py --replay "{'coll': ...}"   (one example,
       as hypothesis prints a failure's spec=)
"""
import argparse
import ast
import faulthandler
import os
import sys
import threading
import time
import traceback
import warnings
from collections import Counter

import numpy as np
from mpi4py import MPI

import commlib
from commlib import CommError, ReduceOp
from harness import Checker, torch, values
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
world = commlib.init()
WORLD = MPI.COMM_WORLD  # verdicts travel over plain mpi4py, not the code under test
size_w, rank_w = world.size, world.rank

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
GOOD_NP = ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"]
GOOD = {"numpy": GOOD_NP, "torch": GOOD_NP + ["bfloat16"]}
BAD = {"numpy": ["complex64", "bool", "longdouble", "int16", "uint16", "uint64", ">f4", ">i8"],
       "torch": ["complex64", "bool", "int16", "uint16", "uint32", "float8_e4m3fn"]}
BAD_BOTH = sorted(set(BAD["numpy"]) & set(BAD["torch"]))
FLOATING = {"float16", "bfloat16", "float32", "float64"}
PAD = 64  # arena bytes before the first and after the last buffer


# --- communicators: made once, up front (creation is collective) -----------------------

def _communicators():
    halves = world.split(rank_w % 2, key=-rank_w)  # reversed rank order inside each half
    head = world.split(0 if rank_w == 0 else 1)    # {0} and the rest
    freed = world.dup()
    freed.free()
    return {"world": (world, 0), "dup": (world.dup(), 0), "halves": (halves, rank_w % 2),
            "head": (head, int(rank_w != 0)), "freed": (freed, 0)}


COMMS = _communicators()


# --- the examples: plain literals, independent of any communicator's size ---------------

ROLES = {"all_reduce": ("t",), "broadcast": ("t",), "reduce": ("t",),
         "reduce_scatter": ("out", "in"), "all_gather": ("out", "in"), "all_to_all": ("out", "in")}
VIEWS_GOOD = ["c", "odd1"]  # C order; C order with odd strides on size-1 dims (contiguous too)
VIEWS_BAD = ["step", "fortran", "padrow", "reverse", "bcast"]
# what a buffer argument may be instead of an array: the error it calls for, and a maker
NOT_ARRAYS = {
    "list": (TypeError, lambda shape: np.zeros(shape).tolist()),
    "pyfloat": (TypeError, lambda shape: 1.0),
    "npscalar": (TypeError, lambda shape: np.float64(1.0)),
    "meta": (ValueError, lambda shape: torch.empty(shape, device="meta")),
    "sparse_coo": (ValueError, lambda shape: torch.ones(3).to_sparse()),
    "sparse_csr": (ValueError, lambda shape: torch.ones(2, 2).to_sparse_csr()),
    "mkldnn": (ValueError, lambda shape: torch.ones(4).to_mkldnn()),
    "nested": (ValueError, lambda shape: torch.nested.nested_tensor(
        [torch.ones(2), torch.ones(3)], layout=torch.jagged)),
}
BOXES_BAD = sorted(NOT_ARRAYS) if torch is not None else ["list", "npscalar", "pyfloat"]
SPLITS_GOOD = ["list", "tuple", "numpy", "torch", "gen"]
SPLITS_BAD = ["len+", "len-", "neg", "sum+", "sum-", "float", "str", "npfloat", "scalar"]
ROOTS_BAD = ["neg", "big", "bool", "float", "str", "none", "npint"]
OPS = ["sum", "avg", "max", "prod", "min"]
OPS_BAD = ["mean", "", None, 3, "sum "]


@st.composite
def cases(draw):
    coll = draw(st.sampled_from(COLLECTIVES))
    dirty = draw(st.booleans())  # False: every dimension is drawn from its valid values

    def bad(rare=False):  # a defect in this dimension? (1 in 4 when dirty; rare: 1 in 8)
        return dirty and all(draw(st.booleans()) for _ in range(3 if rare else 2))

    api = draw(st.sampled_from(["method", "function"]))
    comm = draw(st.sampled_from(["world", "dup", "halves", "head"]))
    if bad(True):
        comm = draw(st.sampled_from(["freed"]
                                    + (["mpi4py", "string"] if api == "function" else [])))
    spec = {"coll": coll, "api": api, "comm": comm, "comm_none": draw(st.booleans()),
            "async": draw(st.booleans()), "salt": draw(st.integers(0, 3)),
            "misalign": draw(st.sampled_from([0, 0, 1, 2, 4, 7]))}
    base = draw(st.sampled_from(["numpy", "torch"] if torch is not None else ["numpy"]))
    roles = ROLES[coll]
    boxes = {r: base for r in roles}
    if len(roles) == 2 and torch is not None and draw(st.integers(0, 3)) == 3:
        boxes["in"] = "torch" if base == "numpy" else "numpy"  # mixed containers
    mixed = len(set(boxes.values())) > 1
    if bad():
        dtype = draw(st.sampled_from(BAD_BOTH if mixed else BAD[base]))
    else:
        dtype = draw(st.sampled_from(GOOD_NP if mixed else GOOD[base]))
    spec["dtype"] = dtype
    if draw(st.integers(0, 9)) == 9:  # now and then a count past the kernels' small paths
        shape = draw(st.sampled_from([(1025,), (4099,), (70001,), (3, 700), (140003,)]))
    else:
        shape = tuple(draw(st.integers(0, 4)) for _ in range(draw(st.sampled_from([1, 2, 0, 3]))))
    spec["shape"] = shape
    spec["roles"] = {}
    for r in roles:
        role = {"box": boxes[r], "view": draw(st.sampled_from(VIEWS_GOOD)), "readonly": False,
                "dtype": None}
        if bad():
            role["view"] = draw(st.sampled_from(VIEWS_BAD))
        if boxes[r] == "numpy" and ((r == "in" and draw(st.integers(0, 3)) == 3) or bad(True)):
            role["readonly"] = True  # fine for inputs, an error for what receives data
        if bad(True):
            role["box"] = draw(st.sampled_from(BOXES_BAD))
        spec["roles"][r] = role
    if len(roles) == 2:
        if bad(True):  # the input's dtype differs from the output's
            others = [d for d in GOOD_NP if d != dtype]
            spec["roles"]["in"]["dtype"] = draw(st.sampled_from(others))
        good = ["separate", "adjacent", "before"] + (["inplace"] if coll != "all_to_all" else [])
        spec["place"] = draw(st.sampled_from(good))
        if bad():
            spec["place"] = draw(st.sampled_from(["shift", "other"] if coll != "all_to_all"
                                                 else ["same", "shift"]))
        spec["gap"] = draw(st.sampled_from([16, 0, 3, 64]))
    if coll in ("reduce_scatter", "all_gather"):
        spec["whole"] = draw(st.sampled_from(["flat", "stacked"]))
        if bad():
            spec["whole"] = draw(st.sampled_from(["plus", "unscaled"]))
    if coll == "all_to_all":
        even = draw(st.booleans())
        spec.update(even=even, unit=draw(st.sampled_from([1, 2, 7, 300])),
                    c=draw(st.integers(0, 3)),
                    matrix=tuple(draw(st.lists(st.integers(0, 3), min_size=16, max_size=16))),
                    a2a_shape=draw(st.sampled_from(["flat", "col"]
                                                   + (["stacked"] if even else []))),
                    indivisible=bool(even and bad()))
        for side in ("in_splits", "out_splits"):
            form = draw(st.sampled_from(SPLITS_GOOD + (["none"] if even else [])))
            if bad():
                form = draw(st.sampled_from(SPLITS_BAD))
            spec[side] = form
    if coll in REDUCING:
        floating = dtype in FLOATING
        op = draw(st.sampled_from(OPS if floating or dirty else [o for o in OPS if o != "avg"]))
        spelling = draw(st.sampled_from(["lower", "upper", "enum", "default"]))
        spec["op"] = ("default", "sum") if spelling == "default" else (spelling, op)
        if bad():
            spec["op"] = ("raw", draw(st.sampled_from(OPS_BAD)))
    if coll in ("broadcast", "reduce"):
        spec["root"] = ("rank", draw(st.integers(0, 7)))
        if bad():
            spec["root"] = (draw(st.sampled_from(ROOTS_BAD)), draw(st.integers(0, 7)))
    kind = draw(st.sampled_from(["pick", "default", "pick", "auto"]))
    spec["algo"] = (kind, draw(st.integers(0, 9)) if kind == "pick" else 0)
    if bad():
        spec["algo"] = (draw(st.sampled_from(["unknown", "unavailable", "int", "list"])), 0)
    return spec


# --- from an example to this rank's buffers and arguments --------------------------------

def itemsize_of(dtype: str) -> int:
    return 1 if dtype == "float8_e4m3fn" else 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s bytes (torch-only dtypes: an unsigned int)."""
    return np.dtype({"bfloat16": "uint16", "float8_e4m3fn": "uint8"}.get(dtype, dtype))


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values -> their bytes in ``dtype``, as storage_dtype(dtype)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.array(x, np.float64)).to(torch.bfloat16).view(
            torch.int16).numpy().view(np.uint16)
    return np.asarray(x).astype(dtype)


def c_strides(shape, e):
    strides, acc = [], e
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def view_strides(shape, e, kind, box):
    c = c_strides(shape, e)
    if not shape or kind == "c":
        return c
    if kind == "reverse" and box != "numpy":
        kind = "step"  # torch has no negative strides
    if kind == "odd1":
        return tuple(999 * e if n == 1 else s for n, s in zip(shape, c))
    if kind == "step":
        return tuple(2 * s for s in c)
    if kind == "fortran":
        return tuple(reversed(c_strides(tuple(reversed(shape)), e)))
    if kind == "padrow":
        return c_strides(shape[:-1] + (shape[-1] + 1,), e)
    if kind == "reverse":
        return (-c[0],) + c[1:]
    if kind == "bcast":
        return (0,) + c[1:]
    raise AssertionError(kind)


def is_contiguous(shape, strides, e) -> bool:
    """C-contiguous as numpy and torch define it: empty, or each dim of size > 1 strided
    exactly by the elements after it (size-1 dims may have any stride)."""
    if 0 in shape:
        return True
    expect = e
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1:
            if s != expect:
                return False
            expect *= n
    return True


def extent(shape, strides, e):
    """(lowest, highest + 1) byte offsets a view touches, relative to its first element."""
    if 0 in shape:
        return 0, 0
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + e
    return lo, hi


def numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def even_splits(total, size):
    return [total // size] * size if total % size == 0 else None


def plan(spec, size, rank):
    """This rank's buffers (shape, strides, place in the arena) and the splits, and the
    example's defects here, each with the exception it calls for (none: must succeed)."""
    coll = spec["coll"]
    errors = {}
    if spec["comm"] == "freed":
        errors["comm freed"] = CommError
    elif spec["comm"] in ("mpi4py", "string"):
        errors["comm " + spec["comm"]] = TypeError
    shape = tuple(spec["shape"])
    m = numel(shape)
    p = {"roles": {}, "splits": {}}
    # shapes per role
    if coll in ("all_reduce", "broadcast", "reduce"):
        shapes = {"t": shape}
    elif coll in ("reduce_scatter", "all_gather"):
        block = "out" if coll == "reduce_scatter" else "in"
        whole = "in" if block == "out" else "out"
        w = spec["whole"]
        whole_shape = {"flat": (size * m,), "stacked": (size,) + shape,
                       "plus": (size * m + 1 + spec["salt"] % 3,), "unscaled": shape}[w]
        shapes = {block: shape, whole: whole_shape}
    else:
        mat = spec["matrix"]
        per = (lambda i, j: spec["c"] * spec["unit"]) if spec["even"] else (
            lambda i, j: mat[4 * i + j] * spec["unit"])
        isplits = [per(rank, j) for j in range(size)]
        osplits = [per(j, rank) for j in range(size)]
        n_in, n_out = sum(isplits) + spec["indivisible"], sum(osplits) + spec["indivisible"]
        form = spec["a2a_shape"]

        def a2a_shape(n):
            if form == "col":
                return (n, 1)
            if form == "stacked" and n % size == 0:
                return (size, n // size)
            return (n,)
        shapes = {"in": a2a_shape(n_in), "out": a2a_shape(n_out)}
        p["splits"] = {"in": isplits, "out": osplits}
    # each role's buffer
    role_ok = {}
    for r, shp in shapes.items():
        role = spec["roles"][r]
        dtype = role["dtype"] or spec["dtype"]
        e = itemsize_of(dtype)
        strides = view_strides(shp, e, role["view"], role["box"])
        q = {"box": role["box"], "dtype": dtype, "shape": shp, "strides": strides, "e": e,
             "numel": numel(shp), "readonly": role["readonly"] and role["box"] == "numpy",
             "contiguous": is_contiguous(shp, strides, e), "extent": extent(shp, strides, e)}
        p["roles"][r] = q
        mine = {}
        if role["box"] in NOT_ARRAYS:
            mine["box " + role["box"]] = NOT_ARRAYS[role["box"]][0]
        else:
            if dtype not in GOOD["torch"] or (dtype == "bfloat16" and role["box"] == "numpy"):
                mine["dtype " + dtype] = TypeError
            if not q["contiguous"]:
                mine["strides " + role["view"]] = ValueError
            if q["readonly"] and r != "in":  # "t" and "out" receive data
                mine["read-only " + r] = ValueError
        role_ok[r] = not mine
        errors.update(mine)
    _place(spec, p, size, rank)
    # what needs both buffers: same dtype, matching counts, no forbidden overlap
    if len(shapes) == 2 and all(role_ok.values()):
        out, inp = p["roles"]["out"], p["roles"]["in"]
        overlap = (out["numel"] and inp["numel"]
                   and out["origin"] < inp["origin"] + inp["numel"] * inp["e"]
                   and inp["origin"] < out["origin"] + out["numel"] * out["e"])
        if out["dtype"] != inp["dtype"]:
            errors["dtype mismatch"] = TypeError
        elif coll in ("reduce_scatter", "all_gather"):
            whole_q, block_q = (inp, out) if coll == "reduce_scatter" else (out, inp)
            if whole_q["numel"] != size * block_q["numel"]:
                errors["count " + spec["whole"]] = ValueError
            own = whole_q["origin"] + rank * block_q["numel"] * block_q["e"]
            if overlap and block_q["origin"] != own:
                errors["alias " + spec["place"]] = ValueError
        else:
            if overlap:
                errors["alias " + spec["place"]] = ValueError
            for side in ("in", "out"):
                error = _splits_errors(spec[side + "_splits"], p, side, size)
                if error:
                    errors[f"{side}_splits {spec[side + '_splits']}"] = error
    if coll in REDUCING:
        kind, op = spec["op"]
        if kind == "raw":
            errors[f"op {op!r}"] = ValueError
        elif op == "avg" and spec["dtype"] in GOOD_NP and spec["dtype"] not in FLOATING:
            errors["avg on " + spec["dtype"]] = ValueError
    if coll in ("broadcast", "reduce"):
        kind, raw = spec["root"]
        if kind in ("neg", "big"):
            errors["root " + kind] = ValueError
        elif kind != "rank":
            errors["root " + kind] = TypeError
    kind = spec["algo"][0]
    if kind in ("unknown", "unavailable", "int"):
        errors["algorithm " + kind] = ValueError
    elif kind == "list":
        errors["algorithm list"] = TypeError
    p["errors"] = errors
    return p


def _splits_errors(form, p, side, size):
    """Errors of an all_to_all side; records the splits it will move in p['splits']."""
    n = p["roles"][side]["numel"]
    if form == "none":
        p["splits"][side] = even_splits(n, size)
        return ValueError if p["splits"][side] is None else None
    if form in ("float", "str", "npfloat", "scalar"):
        return TypeError
    if form in SPLITS_BAD:
        return ValueError
    return None if sum(p["splits"][side]) == n else ValueError


def _place(spec, p, size, rank):
    """Each arena role's 'origin': the byte offset of its first element in the arena."""
    roles = {r: q for r, q in p["roles"].items() if q["box"] in ("numpy", "torch")}
    if not roles:
        p["arena"] = 2 * PAD
        return
    coll = spec["coll"]
    anchor = {"reduce_scatter": "in", "all_gather": "out", "all_to_all": "in"}.get(coll, "t")
    other = {"in": "out", "out": "in"}.get(anchor)
    pos = {}
    if anchor in roles:
        pos[anchor] = 0
    if other in roles:
        a, o = p["roles"][anchor] if anchor in roles else None, p["roles"][other]
        place = spec["place"]
        if a is None:
            pos[other] = 0
        elif place in ("separate", "adjacent"):
            gap = spec["gap"] if place == "separate" else 0
            pos[other] = a["extent"][1] + gap - o["extent"][0]
        elif place == "before":
            pos[other] = a["extent"][0] - spec["gap"] - o["extent"][1]
        elif place == "inplace":
            pos[other] = rank * o["numel"] * o["e"]
        elif place == "other":
            pos[other] = (rank + 1) % size * o["numel"] * o["e"]
        elif place == "same":
            pos[other] = 0
        elif place == "shift":  # one element (rs/ag: past this rank's own block)
            pos[other] = (rank * o["numel"] if coll != "all_to_all" else 0) * o["e"] + o["e"]
    lo = min(pos[r] + roles[r]["extent"][0] for r in pos)
    hi = max(pos[r] + roles[r]["extent"][1] for r in pos)
    shift = PAD + spec["misalign"] - lo
    for r in pos:
        roles[r]["origin"] = pos[r] + shift
    p["arena"] = hi + shift + PAD


# --- materialising one rank's arguments ----------------------------------------------

def op_value(spec):
    kind, op = spec["op"]
    if kind == "lower" or kind == "raw":
        return op
    if kind == "upper":
        return op.upper()
    if kind == "enum":
        return ReduceOp(op)
    raise AssertionError(kind)


def op_name(spec):
    return spec["op"][1]


def input_values(spec, size, rank, role_numel):
    """float64 values this rank's data role holds (its share of the example's data)."""
    coll, salt, dtype = spec["coll"], spec["salt"], spec["dtype"]
    op = op_name(spec) if coll in REDUCING else "sum"
    return values(role_numel, rank, op, dtype, salt)


def materialize(spec, p, comm_size, comm_rank):
    """(arena, {role: object}) with the data roles filled."""
    arena = np.random.default_rng([spec["salt"], rank_w, 7]).integers(
        0, 256, p["arena"], dtype=np.uint8)
    objs = {}
    coll = spec["coll"]
    data_role = {"reduce_scatter": "in", "all_gather": "in", "all_to_all": "in"}.get(coll, "t")
    for r in sorted(p["roles"], key=lambda r: r == data_role):  # the data role written last
        q = p["roles"][r]
        box, dtype, shape = q["box"], q["dtype"], q["shape"]
        if box in NOT_ARRAYS:
            objs[r] = NOT_ARRAYS[box][1](shape)
            continue
        view = np.ndarray(shape, storage_dtype(dtype), buffer=arena, offset=q["origin"],
                          strides=q["strides"])
        if r == data_role and dtype in GOOD["torch"]:
            view[...] = to_storage(input_values(spec, comm_size, comm_rank, q["numel"]),
                                   dtype).reshape(shape)
        if box == "torch":
            t = torch.from_numpy(view)
            if dtype in ("bfloat16", "float8_e4m3fn"):
                t = t.view(getattr(torch, dtype))
            objs[r] = t
        else:
            if q["readonly"]:
                view.flags.writeable = False
            objs[r] = view
    return arena, objs


def splits_value(form, splits, spec):
    if form == "none":
        return None
    s = list(splits)
    if form == "list":
        return s
    if form == "tuple":
        return tuple(s)
    if form == "numpy":
        return np.array(s, dtype=np.int64 if spec["salt"] % 2 else np.int32)
    if form == "torch":
        return torch.tensor(s, dtype=torch.int64) if torch is not None else s
    if form == "gen":
        return (x for x in s)
    if form == "len+":
        return s + [0]
    if form == "len-":
        return s[:-1]
    if form == "neg":
        k = s[0] + 1
        return [s[0] - k] + ([s[1] + k] if len(s) > 1 else []) + s[2:]
    if form == "sum+":
        return [s[0] + 1] + s[1:]
    if form == "sum-":  # one fewer element from the first peer that sends any
        k = next((i for i, x in enumerate(s) if x > 0), None)
        return [x - (i == k) for i, x in enumerate(s)] if k is not None else [s[0] + 1] + s[1:]
    if form == "float":
        return [float(s[0])] + s[1:]
    if form == "str":
        return [str(s[0])] + s[1:]
    if form == "npfloat":
        return np.array(s, dtype=np.float64)
    if form == "scalar":
        return s[0]
    raise AssertionError(form)


def root_value(spec, size):
    kind, raw = spec["root"]
    return {"rank": raw % size, "neg": -1 - raw, "big": size + raw, "bool": bool(raw % 2),
            "float": float(raw % size), "str": str(raw % size), "none": None,
            "npint": np.int64(raw % size)}[kind]


def algo_value(spec, comm, coll):
    kind, idx = spec["algo"]
    if kind == "auto":
        return "auto"
    if kind == "name":  # explicit examples only: an algorithm every communicator here has
        return idx
    if kind == "pick":
        names = comm.algorithms(coll)
        return names[idx % len(names)]
    if kind == "unknown":
        return "bogus"
    if kind == "unavailable":
        missing = sorted(set(commlib.algorithms(coll)) - set(comm.algorithms(coll)))
        return missing[0] if missing else "bogus"
    if kind == "int":
        return 7
    if kind == "list":
        return ["ring"]
    raise AssertionError(kind)


# --- what the result must be ----------------------------------------------------------

REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "avg": np.add}


def expected_output(spec, plans, size, rank):
    """float64 values the output role must hold on this rank."""
    coll, me = spec["coll"], plans[rank]

    def data(q):  # rank q's input values
        role = "t" if coll in ("all_reduce", "broadcast", "reduce") else "in"
        return input_values(spec, size, q, plans[q]["roles"][role]["numel"])

    def reduced(count_slice=None):
        op = op_name(spec)
        total = data(0)
        for q in range(1, size):
            total = REDUCE[op](total, data(q))
        if count_slice is not None:
            total = total[count_slice]
        return total / size if op == "avg" else total

    if coll == "all_reduce":
        return reduced()
    if coll == "reduce":
        return reduced() if rank == root_value(spec, size) else data(rank)
    if coll == "broadcast":
        return data(root_value(spec, size))
    if coll == "reduce_scatter":
        m = me["roles"]["out"]["numel"]
        return reduced(slice(rank * m, (rank + 1) * m))
    if coll == "all_gather":
        return np.concatenate([data(q) for q in range(size)])
    parts = []  # all_to_all: rank q's part for this rank
    for q in range(size):
        sp = plans[q]["splits"]["in"]
        start = sum(sp[:rank])
        parts.append(data(q)[start:start + sp[rank]])
    return np.concatenate(parts) if parts else np.zeros(0)


# --- one example on this rank ---------------------------------------------------------

def run_example(spec):
    """Run ``spec`` here; return this rank's record: outcome, ok, why."""
    name = spec["comm"]
    comm, color = COMMS["world" if name in ("mpi4py", "string") else name]
    size, rank = comm.size, comm.rank
    plans = [plan(spec, size, q) for q in range(size)]
    p = plans[rank]
    record = {"color": (name, color), "outcome": None, "ok": True, "why": "",
              "defects": sorted(p["errors"])}
    if len({not q["errors"] for q in plans}) > 1:
        # valid on some ranks of the communicator, an error on others: the valid ones
        # would wait in the collective for peers that raised (see the docstring)
        record["outcome"] = "excluded"
        return record
    arena, objs = materialize(spec, p, size, rank)
    before = arena.copy()
    coll = spec["coll"]
    kwargs = {}
    if spec["algo"][0] != "default":
        kwargs["algorithm"] = algo_value(spec, comm, coll)
    if coll in REDUCING and spec["op"][0] != "default":
        kwargs["op"] = op_value(spec)
    if coll in ("broadcast", "reduce"):
        kwargs["root"] = root_value(spec, size)
    if spec["async"]:
        kwargs["async_op"] = True
    if coll == "all_to_all":
        kwargs["output_splits"] = splits_value(spec["out_splits"], p["splits"]["out"], spec)
        kwargs["input_splits"] = splits_value(spec["in_splits"], p["splits"]["in"], spec)
    args = [objs["t"]] if "t" in objs else [objs["out"], objs["in"]]
    if spec["api"] == "method":
        fn = getattr(comm, coll)
    else:
        fn = getattr(commlib, coll)
        kwargs["comm"] = {"mpi4py": WORLD, "string": "world"}.get(
            name, None if name == "world" and spec["comm_none"] else comm)
    stage = "call"
    try:
        got = fn(*args, **kwargs)
        if spec["async"]:
            stage = "wait"
            assert isinstance(got, commlib.Work), f"async_op returned {type(got).__name__}"
            got.wait(timeout=60)
            got = got.result
    except Exception as e:  # noqa: BLE001 - judged below
        record["outcome"] = type(e).__name__
        if not p["errors"]:
            return _fail(record, f"raised at {stage}: {type(e).__name__}: {e}")
        if not isinstance(e, tuple(p["errors"].values())):
            return _fail(record, f"raised {type(e).__name__} ({e}) at {stage}; expected "
                         f"{_expected(p)}")
        if stage != "call":
            return _fail(record, f"the error came from the Work, not the call: {e}")
        if not np.array_equal(arena, before):
            return _fail(record, f"{type(e).__name__} raised, but {_diff(arena, before)}")
        return record
    record["outcome"] = "result"
    if p["errors"]:
        return _fail(record, f"returned; expected {_expected(p)}")
    result_role = "t" if "t" in objs else "out"
    if got is not objs[result_role]:
        return _fail(record, f"returned {type(got).__name__}, not the caller's tensor")
    q = p["roles"][result_role]
    lo, hi = q["origin"], q["origin"] + q["numel"] * q["e"]
    outside = np.concatenate([arena[:lo], arena[hi:]])
    if not np.array_equal(outside, np.concatenate([before[:lo], before[hi:]])):
        return _fail(record, "bytes outside the output changed: " + _diff(arena, before, lo, hi))
    want = expected_output(spec, plans, size, rank)
    averaged = coll in REDUCING and op_name(spec) == "avg" and (
        coll != "reduce" or rank == root_value(spec, size))
    if averaged and size > 1:
        got_v = _as_f64(arena[lo:hi], q["dtype"])
        tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[q["dtype"]]
        if not np.allclose(got_v, want, rtol=tol, atol=tol):
            return _fail(record, f"avg differs: got {got_v[:8]}, expected {want[:8]}")
    else:
        want_bytes = to_storage(want, q["dtype"]).reshape(-1).view(np.uint8)
        if not np.array_equal(arena[lo:hi], want_bytes):
            got_v = _as_f64(arena[lo:hi], q["dtype"])
            bad = np.flatnonzero(got_v != want)
            first = int(bad[0]) if bad.size else -1
            return _fail(record, f"wrong output: {bad.size} of {want.size} elements differ, "
                         f"first at {first}: got {got_v[first] if bad.size else '?'}, "
                         f"expected {want[first] if bad.size else '?'} (bytes differ)")
    return record


def _expected(p):
    return ", ".join(f"{t.__name__} ({why})" for why, t in sorted(p["errors"].items()))


def _as_f64(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return torch.from_numpy(raw.copy().view(np.int16)).view(torch.bfloat16).to(
            torch.float64).numpy()
    return raw.view(np.dtype(dtype)).astype(np.float64)


def _diff(arena, before, lo=None, hi=None):
    changed = np.flatnonzero(arena != before)
    if lo is not None:
        changed = changed[(changed < lo) | (changed >= hi)]
    where = f"; output is bytes [{lo}, {hi})" if lo is not None else ""
    return (f"{changed.size} arena bytes changed, first at byte {changed[:4].tolist()}{where} "
            f"(arena of {arena.size})")


def _fail(record, why):
    record["ok"], record["why"] = False, why
    return record


# --- running examples on every rank ---------------------------------------------------

STOP = "stop"
TALLY = Counter()  # (collective, outcome) over every example run (shrinking included)
KINDS = Counter()  # outcome over examples: result, ValueError, ..., mixed, excluded
DEFECTS = Counter()  # the defects rank 0's examples had
EXCLUDED = []  # examples valid on some ranks only (bug B1), not run
WATCHDOG_SECONDS = 60


def everywhere(spec):
    """Run one example on every rank; the verdict, the same on every rank: None if good."""
    timer = threading.Timer(WATCHDOG_SECONDS, _hung, args=(spec,))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS + 30, exit=True)
    try:
        try:
            record = run_example(spec)
        except Exception:  # noqa: BLE001 - a failure of the fuzzer or the library: report it
            record = {"color": None, "outcome": "crash", "ok": False,
                      "why": traceback.format_exc()[-1500:]}
        records = WORLD.allgather(record)
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    problems = [f"rank {r}: {rec['why']}" for r, rec in enumerate(records) if not rec["ok"]]
    groups = {}  # a communicator's ranks all return, or all raise (the types may differ:
    for r, rec in enumerate(records):  # each rank reports the first of its own defects)
        groups.setdefault(rec["color"], {})[r] = rec["outcome"]
    for color, outcomes in groups.items():
        if len({o == "result" for o in outcomes.values()}) > 1:
            problems.append(f"ranks of communicator {color} disagree: {outcomes}")
    outcomes = {rec["outcome"] for rec in records}
    DEFECTS.update(records[0].get("defects", ()))
    if "excluded" in outcomes:
        EXCLUDED.append(spec)
    TALLY[spec["coll"], records[0]["outcome"]] += 1
    KINDS["excluded" if "excluded" in outcomes else outcomes.pop() if len(outcomes) == 1
          else "mixed"] += 1
    return "; ".join(problems) or None


def _hung(spec):
    print(f"[rank {rank_w}] example still running after {WATCHDOG_SECONDS} s, ending the job:\n"
          f"  {spec!r}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(70)


# known-tricky cases, run before the drawn ones (hypothesis' explicit phase)
def _explicit(coll, **over):
    roles = {r: {"box": "numpy", "view": "c", "readonly": False, "dtype": None}
             for r in ROLES[coll]}
    spec = {"coll": coll, "api": "method", "comm": "world", "comm_none": False, "async": False,
            "salt": 1, "misalign": 0, "dtype": "float32", "shape": (3,), "roles": roles,
            "algo": ("default", 0)}
    if len(roles) == 2:
        spec.update(place="separate", gap=0)
    if coll in ("reduce_scatter", "all_gather"):
        spec["whole"] = "flat"
    if coll == "all_to_all":
        spec.update(even=False, unit=1, c=1, matrix=tuple(range(16)), a2a_shape="flat",
                    indivisible=False, in_splits="list", out_splits="list")
    if coll in REDUCING:
        spec["op"] = ("lower", "sum")
    if coll in ("broadcast", "reduce"):
        spec["root"] = ("rank", 1)
    for key, value in over.items():
        if "." in key:
            role, field = key.split(".")
            spec["roles"][role][field] = value
        else:
            spec[key] = value
    return spec


EXPLICIT = [
    _explicit("reduce_scatter", place="inplace", whole="stacked"),
    _explicit("all_gather", place="inplace", dtype="int8", shape=(2, 2)),
    _explicit("reduce_scatter", place="shift", shape=(4,)),
    _explicit("all_gather", place="other", shape=(4,)),
    _explicit("all_to_all", place="adjacent", misalign=1),
    _explicit("all_to_all", place="same", even=True, in_splits="none", out_splits="none"),
    _explicit("all_to_all", even=True, indivisible=True, in_splits="none", out_splits="none"),
    _explicit("all_reduce", shape=(), misalign=3, dtype="float64"),
    _explicit("all_reduce", shape=(2, 0, 3), op=("lower", "avg"), dtype="int32"),
    _explicit("broadcast", root=("neg", 0), dtype="int64"),
    _explicit("reduce", root=("bool", 1)),
    _explicit("all_reduce", **{"t.view": "fortran", "shape": (2, 3)}),
    _explicit("all_reduce", **{"t.view": "odd1", "shape": (1, 3, 1)}),
    _explicit("all_gather", **{"in.readonly": True}),
    _explicit("all_reduce", **{"t.readonly": True}),
    _explicit("all_reduce", **{"t.box": "torch", "dtype": "bfloat16", "op": ("lower", "avg")}),
    _explicit("all_reduce", **{"t.box": "torch", "dtype": "complex64"}),
    _explicit("all_gather", **{"in.box": "torch", "in.view": "bcast", "shape": (3, 2)}),
    _explicit("all_reduce", **{"t.box": "sparse_csr"}),
    _explicit("broadcast", api="function", comm="mpi4py"),
    _explicit("reduce", comm="freed"),
    _explicit("all_to_all", in_splits="npfloat", out_splits="gen"),
    # one element with a stride of 999: contiguous for torch, and what MPI sends is its bytes
    _explicit("all_reduce", **{"t.box": "torch", "t.view": "odd1", "shape": (1,),
                               "algo": ("name", "native")}),
    _explicit("all_gather", **{"in.box": "torch", "in.view": "odd1", "out.box": "torch",
                               "shape": (1, 1), "algo": ("name", "native")}),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-explicit", action="store_true", help="drawn examples only")
    parser.add_argument("--seed", type=int, help="hypothesis' seed (default: 1000 + ranks)")
    parser.add_argument("--replay", help="one example (the spec= of a failure) to run alone")
    args = parser.parse_args()
    faulthandler.enable()
    check = Checker()
    start = time.monotonic()
    if args.replay:
        verdict = everywhere(ast.literal_eval(args.replay))
        check.cases = 1
        if verdict:
            check.failures.append(verdict)
        _summary(start, args)
        check.finish()
    if rank_w != 0:  # follow rank 0's examples until it says stop
        while (spec := WORLD.bcast(None)) != STOP:
            everywhere(spec)
        check.cases = WORLD.bcast(None)
        check.finish()

    seen = []

    def verbose(spec):
        if args.verbose:
            print(f"example {len(seen)}: {spec!r}", flush=True)
        seen.append(1)

    # reproducible (a fixed seed, no database), and different examples at each world size
    @seed(args.seed if args.seed is not None else 1000 + size_w)
    @settings(database=None, max_examples=args.examples, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(spec=cases())
    def fuzz(spec):
        verbose(spec)
        WORLD.bcast(spec)
        verdict = everywhere(spec)
        assert verdict is None, verdict

    for spec in [] if args.no_explicit else EXPLICIT:
        fuzz = example(spec=spec)(fuzz)
    try:
        fuzz()
    except Exception as e:  # noqa: BLE001 - hypothesis raises the shrunk example's failure
        check.failures.append(f"fuzz: {type(e).__name__}: {e}"[:4000])
        traceback.print_exc()
    finally:
        WORLD.bcast(STOP)
    check.cases = len(seen)
    WORLD.bcast(check.cases)
    _summary(start, args)
    check.finish()


def _summary(start, args):
    took = time.monotonic() - start
    if rank_w != 0:
        return
    per = {}
    for (coll, outcome), k in sorted(TALLY.items()):
        per.setdefault(coll, []).append(f"{outcome}={k}")
    kinds = " ".join(f"{k}={v}" for k, v in sorted(KINDS.items()))
    print(f"fuzz-summary: ranks={size_w} examples={sum(KINDS.values())} {kinds} "
          f"seconds={took:.1f}", flush=True)
    for coll in COLLECTIVES:
        print(f"  {coll}: {' '.join(per.get(coll, []))}", flush=True)
    print("  defects: " + ", ".join(f"{why}={k}" for why, k in DEFECTS.most_common()), flush=True)
    for spec in EXCLUDED[:3]:
        print(f"  excluded (valid on some ranks only): {spec!r}", flush=True)


if __name__ == "__main__":
    main()
