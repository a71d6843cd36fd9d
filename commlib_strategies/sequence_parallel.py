"""Sequence shards: what Megatron sequence parallelism (megatron_sp.py) and context
parallelism (context_parallel.py) share, when a group of ranks shares the work on each
sequence.

Vocabulary. Activations are (batch, time, width). A tensor is *sequence-sharded* over a
group of n ranks when rank r holds the r-th of n equal contiguous chunks along time: the
tokens [r*T/n, (r+1)*T/n), its *shard*. ``sequence_shard`` cuts one out of a full batch.

Gradients. A parameter applied to a shard gets only that shard's part of its gradient. Such
parameters (under cp all of them; under Megatron SP those TP does not split: LayerNorms, the
position embedding, row-parallel biases) carry a hook that sums their gradient over the group
as autograd produces it, before it is accumulated: after ``loss.backward()`` every parameter
holds its full gradient, as in the unsharded model, so DataParallel or ZeRO over dp wrap
these models unchanged. The loss is the mean over every token of the batch: per-shard sums,
divided by the global token count, summed over the group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib_strategies.mappings import reduce_from_group


def sequence_shard(t: torch.Tensor, group: commlib.Communicator) -> torch.Tensor:
    """This rank's shard of ``t`` (batch, time, ...) along time (a view)."""
    check_time(t.shape[1], group)
    return t.chunk(group.size, 1)[group.rank]


def check_time(time: int, group: commlib.Communicator, name: str = "group") -> None:
    if time % group.size:
        raise ValueError(f"sequence length {time} is not divisible by the {name} size "
                         f"{group.size}; use a sequence length that is a multiple of {group.size}")


def positions(local_time: int, group: commlib.Communicator, device) -> torch.Tensor:
    """The global positions (1, local_time) of this rank's shard of each sequence."""
    check_time(local_time * group.size, group)
    start = group.rank * local_time
    return torch.arange(start, start + local_time, device=device).unsqueeze(0)


def sum_replicated_gradients(module: nn.Module, group: commlib.Communicator) -> None:
    """Hook every parameter of ``module`` that tensor parallelism does not split (held whole,
    used on a sequence shard under Megatron SP) to sum its gradient over ``group``. Hooks do
    not survive copying a parameter: whoever copies such modules calls
    ``rehook_gradient_sums`` on the copy."""
    for p in module.parameters():
        if getattr(p, "tp_split_dim", None) is None:
            sum_gradient_over(p, group)


def sum_gradients(module: nn.Module, group: commlib.Communicator) -> None:
    """Hook every parameter of ``module`` (a context-parallel model's: all are used on
    sequence shards) to sum its gradient over ``group``. As for
    ``sum_replicated_gradients``, whoever copies such modules calls ``rehook_gradient_sums``
    on the copy."""
    for p in module.parameters():
        sum_gradient_over(p, group)


def rehook_gradient_sums(module: nn.Module) -> None:
    """Hook every parameter of ``module``, a copy whose parameters were given the originals'
    attributes, as its original was: ``summed_over`` names the groups (the hooks themselves
    are not copied). A parameter is hooked once per group, however the model was built (under
    Megatron SP a MoE layer's experts take whole sequences and are not hooked at all)."""
    for p in module.parameters():
        for group in getattr(p, "summed_over", ()):
            _hook_sum(p, group)


def sum_gradient_over(param: nn.Parameter, group: commlib.Communicator) -> None:
    """Make ``param``'s incoming gradient the sum over ``group`` (see the module docstring),
    and record it for copies (``rehook_gradient_sums``). Once per group: a parameter that
    both sees only a tp rank's heads (plans.Plan.tp_summed) and, under Megatron SP, is held
    whole needs one sum over tp. A parameter without gradient (a frozen one, or a
    routing bias a model updates by itself) has nothing to sum."""
    if (group.size > 1 and param.requires_grad
            and group not in getattr(param, "summed_over", ())):
        param.summed_over = getattr(param, "summed_over", ()) + (group,)
        _hook_sum(param, group)


def _hook_sum(param: nn.Parameter, group: commlib.Communicator) -> None:
    def summed(grad):
        total = grad.contiguous().clone()
        group.all_reduce(total)
        return total
    param.register_hook(summed)


def sequence_sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                   group: commlib.Communicator) -> torch.Tensor:
    """Mean cross-entropy over every token, of logits (B, T/n, V) sequence-sharded over the
    group (fp32). The value is replicated; backward gives each rank its own tokens' part."""
    local = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return reduce_from_group(local.reshape(1) / (targets.numel() * group.size), group)[0]
