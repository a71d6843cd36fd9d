"""Dtypes, reduce ops and staging for commlib's torch backend (commlib/torch/backend.py).

commlib moves and reduces flat contiguous buffers of a few dtypes. These helpers turn
torch's tensors and ReduceOps into that: views in a dtype commlib handles, the commlib op
(or a local fold where commlib has none), and finish steps that copy staged results back
into the caller's tensors.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import _C

# What commlib reduces natively; anything else moves as raw bytes.
COMMLIB_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                            torch.int8, torch.uint8, torch.int32, torch.int64})
_R = dist.ReduceOp.RedOpType
_NATIVE = {_R.SUM: "sum", _R.PRODUCT: "prod", _R.MIN: "min", _R.MAX: "max", _R.AVG: "avg",
           _R.BAND: "band", _R.BOR: "bor", _R.BXOR: "bxor"}
_BITWISE = frozenset({_R.BAND, _R.BOR, _R.BXOR})  # integer dtypes only
# bool travels as uint8 0/1, where "or" is max and "and" is min (gloo: SUM is OR, PROD AND).
_BOOL = {_R.SUM: "max", _R.MAX: "max", _R.BOR: "max", _R.PRODUCT: "min", _R.MIN: "min",
         _R.BAND: "min", _R.BXOR: torch.bitwise_xor}


def _teach_fast_path() -> None:
    """Let commlib's fast path take torch's ReduceOp objects as they come in an op's
    options (it reads their kind from their hash: cheaper than ``.op``, which makes two
    Python objects per call). Where this torch's ReduceOp hashes otherwise, the fast path
    declines them and the backend's general route maps them (``reduction``)."""
    reduce_op = type(dist.AllreduceOptions().reduceOp)
    kinds = {int(kind): name for kind, name in _NATIVE.items()}
    if any(hash(reduce_op(kind)) != int(kind) for kind in _NATIVE):
        return
    _C.take_torch_ops(reduce_op, [_C.OPS[kinds[k]] if k in kinds else -1
                                  for k in range(max(kinds) + 1)])


_teach_fast_path()



def reduction(reduce_op, dtype: torch.dtype, what: str):
    """commlib's op name for ``reduce_op`` on ``dtype``, or a fold function (bool's xor)."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    # Remembered, as working it out costs more than a small all-reduce; keyed by the enum's
    # value: torch's enum objects are made anew per access and compare slowly.
    key = (kind.value, dtype, what)
    op = _REDUCTIONS.get(key)
    if op is None:
        op = _REDUCTIONS[key] = _reduction(kind, dtype, what)
    return op


_REDUCTIONS: dict = {}


def premultiplied(reduce_op, t: torch.Tensor, what: str) -> torch.Tensor | None:
    """For NCCL's PREMUL_SUM (``dist._make_nccl_premul_sum(factor)``, which FSDP2 uses):
    ``t`` times the op's factor (a number, or a tensor of one element), a new contiguous
    tensor that a SUM then reduces; None for any other op."""
    if not isinstance(reduce_op, dist.ReduceOp) or reduce_op.op != _R.PREMUL_SUM:
        return None
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"commlib backend: {what} with ReduceOp.PREMUL_SUM needs a floating "
                        f"or complex dtype (as NCCL's), got {t.dtype}")
    factor = reduce_op.factor  # (a tensor's has one element: torch checks)
    if isinstance(factor, torch.Tensor):
        factor = factor.to(device=t.device, dtype=t.dtype).reshape(())
    return (t * factor).contiguous()


def _reduction(kind, dtype: torch.dtype, what: str):
    name = str(kind).rsplit(".", 1)[-1]
    if kind == _R.PREMUL_SUM:  # (premultiplied's inputs, then summed)
        kind = _R.SUM
    if dtype == torch.bool:
        op = _BOOL.get(kind)
    elif dtype.is_complex:
        op = _NATIVE[kind] if kind in (_R.SUM, _R.AVG) else None
    elif dtype not in COMMLIB_DTYPES:
        raise TypeError(f"commlib backend: {what} cannot reduce {dtype}; reductions take "
                        f"bool, complex and {', '.join(sorted(str(d) for d in COMMLIB_DTYPES))}")
    elif kind in _BITWISE and dtype.is_floating_point:
        raise ValueError(f"Cannot use ReduceOp.{name} with non-integral dtype {dtype}")
    else:
        op = _NATIVE.get(kind)
        if op == "avg" and not dtype.is_floating_point:
            raise TypeError(f"commlib backend: ReduceOp.AVG needs a floating dtype, got {dtype}")
    if op is None:
        raise ValueError(f"commlib backend: {what} does not support ReduceOp.{name} on {dtype}")
    return op


def reduce_view(t: torch.Tensor) -> torch.Tensor:
    """Flat view of contiguous ``t`` in a dtype commlib reduces (bool as uint8, complex as
    its real pairs)."""
    if t.is_complex():
        return torch.view_as_real(t).reshape(-1)
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if t.dtype == torch.bool else flat


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat view of contiguous ``t`` that commlib can move: itself, or its raw bytes."""
    flat = t.reshape(-1)
    return flat if t.dtype in COMMLIB_DTYPES else flat.view(torch.uint8)


def sparse_sum(all_gather, t: torch.Tensor, size: int) -> torch.Tensor:
    """The sum over ``size`` ranks of sparse COO ``t`` (as gloo's sparse all-reduce), with
    ``all_gather(out, inp)`` over them: each rank's entry count, then every rank's indices
    and values (padded to the most any rank has), coalesced into one tensor."""
    local = t.coalesce()
    counts = torch.zeros(size, dtype=torch.int64)
    all_gather(counts, torch.tensor([local._nnz()]))
    most = int(counts.max())
    parts = []
    for mine, axis in ((local.indices(), 1), (local.values(), 0)):  # (dims, nnz), (nnz, ...)
        padded = mine.new_zeros(mine.shape[:axis] + (most,) + mine.shape[axis + 1:])
        padded.narrow(axis, 0, mine.shape[axis]).copy_(mine)
        rows = padded.new_empty((size, *padded.shape))
        all_gather(byte_view(rows), byte_view(padded))
        parts.append(torch.cat([rows[r].narrow(axis, 0, int(c)) for r, c in
                                enumerate(counts)], axis))
    return torch.sparse_coo_tensor(parts[0], parts[1], t.shape, check_invariants=False).coalesce()


def per_element(dtype: torch.dtype) -> int:
    """Elements of ``byte_view`` per tensor element."""
    return 1 if dtype in COMMLIB_DTYPES else dtype.itemsize


def contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def fold(fn, rows: torch.Tensor) -> torch.Tensor:
    return functools.reduce(fn, rows.unbind(0))


def only(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"commlib backend: {what} takes one tensor per process, got "
                         f"{len(tensors)}")
    return tensors[0]


def alike(tensors, ref: torch.Tensor, what: str) -> None:
    """Each of ``tensors`` holds as many elements of the same dtype as ``ref`` (a copy
    between them would otherwise convert, or fail with a message about views)."""
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype or t.numel() != ref.numel():
            raise ValueError(f"commlib backend: {what} {i} is {t.dtype}{list(t.shape)}, "
                             f"which does not match {ref.dtype}{list(ref.shape)}; pass "
                             f"tensors of the same dtype and number of elements")


def copy_back(pairs):
    """Finish step: copy each staged result into the user's tensor it stands in for."""
    def finish():
        for dst, src in pairs:
            if dst is not src:
                dst.copy_(src.view(dst.shape))
    return finish


def in_order(*steps):
    """One finish step running ``steps`` (None entries skipped) in order."""
    steps = [s for s in steps if s is not None]

    def finish():
        for step in steps:
            step()
    return finish


def row_splits(splits, t, flat):
    """torch's dim-0 row counts -> element counts of ``flat`` (None: equal parts)."""
    if not splits:
        return None
    per_row = flat.numel() // t.shape[0] if t.numel() else 0
    return [s * per_row for s in splits]
