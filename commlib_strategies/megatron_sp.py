"""Megatron sequence parallelism, on the tp group, for any model with a plan (plans.py):
what tensor parallelism leaves replicated (norms, residual adds, dropout) runs on sequence
shards (sequence_parallel.py's vocabulary).

The residual stream is sharded along time from the first block's input to the final norm's
output. Where tensor parallelism copies a replicated input into its column-parallel linears,
the plan's tp regions (attention, MLP) all-gather their input along time instead, so an
attention that derives its shapes from its input sees whole sequences; where it all-reduces
a row-parallel output, the row-parallel linear reduce-scatters it along time. Same traffic
as tensor parallelism (an all-reduce is a reduce-scatter plus an all-gather), but what lies
between the regions holds 1/tp of the activations.

A region keeps only this rank's shard of its gathered input for backward: its
column-parallel linears multiply the gathered input through ``gathered_matmul``, which saves
the shard, and the first of them to run backward all-gathers it again for all of them.

Parameters used on shards (the blocks' and the final norm's that tp does not split) sum
their gradients over tp (``sum_replicated_gradients``).
"""
from __future__ import annotations

import torch
from torch import nn

import commlib
from commlib_strategies.mappings import gather_along, gather_for_partial, split_along
from commlib_strategies.plans import Plan, matching
from commlib_strategies.sequence_parallel import check_time, sum_replicated_gradients


def shard_sequences_(model: nn.Module, group: commlib.Communicator, plan: Plan) -> None:
    """Megatron sequence parallelism over ``group`` by the plan's ``sequence`` (first
    block, final norm, tp regions), in place, on a model whose tp regions' linears were
    made column- and row-parallel for it (``gathered``, ``sequence_dim``)."""
    if not plan.sequence:
        raise ValueError(f"megatron sequence parallel: the plan for {type(model).__name__} "
                         "names no (first block, final norm)")
    first, final, regions = plan.sequence
    names = {m: name for name, m in model.named_modules()}
    for region in regions:  # whole sequences in, for the column-parallel linears
        for m in matching(model, region):
            m.register_forward_pre_hook(_on_hidden(lambda x: _gather_region_input(x, group)),
                                        with_kwargs=True)
    for block in matching(model, first):  # the residual stream to this rank's shard
        split_before(block, group)
        sum_replicated_gradients(model.get_submodule(names[block].rsplit(".", 1)[0]), group)
    for norm in matching(model, final):
        norm.register_forward_hook(lambda m, args, out: gather_along(out, group, 1))
        sum_replicated_gradients(norm, group)
    model.sequence_group = group  # (a pipeline piece past the first shards its input again)


def split_before(block: nn.Module, group: commlib.Communicator) -> None:
    """Shard ``block``'s input (whole sequences) along time over ``group``, in place."""
    def split(x):
        check_time(x.shape[1], group, "tp")
        return split_along(x, group, 1)
    block.register_forward_pre_hook(_on_hidden(split), with_kwargs=True)


def _on_hidden(change):
    """A forward pre-hook applying ``change`` to a module's hidden states (its first
    argument, or transformers' ``hidden_states`` keyword)."""
    def hook(module, args, kwargs):
        if args:
            return (change(args[0]),) + args[1:], kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return hook


def _gather_region_input(shard: torch.Tensor, group: commlib.Communicator) -> torch.Tensor:
    full = gather_for_partial(shard, group, 1)
    full.megatron_region = _RegionInput(shard.detach(), group)  # (for gathered_matmul)
    return full


class _RegionInput:
    """A region's gathered input as its linears' backward needs it: the region's input
    shard, which they save, all-gathered again by the first of them and shared with the
    others."""

    def __init__(self, shard: torch.Tensor, group: commlib.Communicator):
        self.shard, self.group, self.users, self.full = shard, group, 0, None

    def regathered(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                self.full = gather_along(shard, self.group, 1)
        full = self.full
        self.users -= 1
        if self.users <= 0:  # the last user: let it go (a second backward gathers again)
            self.full = None
        return full


def gathered_matmul(x: torch.Tensor, weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """``x`` times a column-parallel linear's ``weight`` (its output features along
    ``out_dim``: nn.Linear's 0, Conv1D's 1). For ``x`` a tp region's gathered input, only
    this rank's shard of it is saved for backward."""
    region = getattr(x, "megatron_region", None)
    if region is None:
        return x @ weight if out_dim else torch.nn.functional.linear(x, weight)
    region.users += 1
    return _KeepShard.apply(x, weight, out_dim, region)


class _KeepShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dim, region):
        ctx.save_for_backward(region.shard, weight)
        ctx.out_dim, ctx.region = out_dim, region
        return x @ weight if out_dim else torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        x = ctx.region.regathered(shard)
        w = weight if ctx.out_dim else weight.t()  # as (in, out)
        rows, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t() @ grads
        return grad @ w.t(), grad_w if ctx.out_dim else grad_w.t(), None, None
