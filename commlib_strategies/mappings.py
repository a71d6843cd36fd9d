"""Every autograd-aware communication op, each a small autograd.Function taking its group.

Vocabulary: a tensor is *replicated* when every rank of the group holds the same value,
*partial* when the true value is the sum over the group's ranks, and *split along dim*
when rank r holds the r-th of ``group.size`` equal chunks of the full tensor along dim.
Each op's backward is the op that maps the gradients the same way back:

    copy_to_group        replicated -> used by each rank      bwd: all-reduce
    reduce_from_group    partial -> replicated                bwd: identity
    gather_along         split -> replicated (all-gather)     bwd: split
    split_along          replicated -> split                  bwd: all-gather
    reduce_scatter_along partial -> split                     bwd: all-gather
    gather_for_partial   split -> replicated, used by each    bwd: reduce-scatter
                         rank for its partial result
    all_to_all           split on one dim -> split on another bwd: the reverse all-to-all
    all_to_all_uneven    rows to each rank, in given counts   bwd: the reverse (counts swapped)
"""
from __future__ import annotations

import math

import torch

import commlib


def copy_to_group(x: torch.Tensor, group: commlib.Communicator) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: commlib.Communicator) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def gather_along(x: torch.Tensor, group: commlib.Communicator, dim: int) -> torch.Tensor:
    return _GatherAlong.apply(x, group, dim)


def gather_for_partial(x: torch.Tensor, group: commlib.Communicator, dim: int) -> torch.Tensor:
    """All-gather along ``dim``, for a computation whose result is partial over the group
    (column-parallel slices): the gradients that come back are partial too, so backward
    reduce-scatters them."""
    return _GatherForPartial.apply(x, group, dim)


def split_along(x: torch.Tensor, group: commlib.Communicator, dim: int) -> torch.Tensor:
    return _SplitAlong.apply(x, group, dim)


def reduce_scatter_along(x: torch.Tensor, group: commlib.Communicator, dim: int) -> torch.Tensor:
    return _ReduceScatterAlong.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group: commlib.Communicator, scatter_dim: int,
               gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one chunk per rank, send chunk j to rank j, and
    concatenate what arrives along ``gather_dim`` (in rank order)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def all_to_all_uneven(x: torch.Tensor, group: commlib.Communicator, send_rows: list,
                      recv_rows: list) -> torch.Tensor:
    """Send rows of ``x`` (dim 0) to each rank in turn, ``send_rows[j]`` of them to rank j,
    and concatenate the rows that arrive in rank order, ``recv_rows[j]`` of them from rank j.
    The counts must agree across ranks (what rank i sends to j is what j receives from i);
    the caller exchanges them first."""
    return _AllToAllUneven.apply(x, group, tuple(send_rows), tuple(recv_rows))


# ------------------------------------------------------------------------ the primitives
# Plain functions on tensors (no autograd), shared by the forward and backward passes.

def _all_reduce(x, group):
    out = x.contiguous().clone()  # never reduce into a tensor autograd may still read
    group.all_reduce(out)
    return out


def _split(x, group, dim):
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(f"cannot split dim {dim} of size {size} into {group.size} equal parts")
    return x.chunk(group.size, dim)[group.rank].contiguous()


def _gather(x, group, dim):
    front = x.movedim(dim, 0).contiguous()  # all_gather concatenates along the first dim
    out = front.new_empty((group.size * front.shape[0],) + front.shape[1:])
    group.all_gather(out, front)
    return out.movedim(0, dim)


def _reduce_scatter(x, group, dim):
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over "
                         f"{group.size} ranks: it must divide evenly")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // group.size,) + front.shape[1:])
    group.reduce_scatter(out, front)
    return out.movedim(0, dim)


def _all_to_all(x, group, scatter_dim, gather_dim):
    if x.shape[scatter_dim] % group.size:
        raise ValueError(f"cannot scatter dim {scatter_dim} of size {x.shape[scatter_dim]} "
                         f"over {group.size} ranks: it must divide evenly")
    send = torch.stack(x.chunk(group.size, scatter_dim)).contiguous()  # chunk j goes to rank j
    received = torch.empty_like(send)
    group.all_to_all(received, send)
    return torch.cat(received.unbind(0), gather_dim)


def _all_to_all_uneven(x, group, send_rows, recv_rows):
    if sum(send_rows) != x.shape[0]:
        raise ValueError(f"all_to_all_uneven: send_rows sum to {sum(send_rows)}, but the "
                         f"tensor has {x.shape[0]} rows")
    row = math.prod(x.shape[1:])  # commlib's splits count elements, not rows
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + x.shape[1:])
    group.all_to_all(out, x, output_splits=[r * row for r in recv_rows],
                     input_splits=[r * row for r in send_rows])
    return out


# ------------------------------------------------------------------------ autograd

class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherForPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_rows, recv_rows):
        ctx.group, ctx.rows = group, (send_rows, recv_rows)
        return _all_to_all_uneven(x, group, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.rows
        return _all_to_all_uneven(grad, ctx.group, recv_rows, send_rows), None, None, None
