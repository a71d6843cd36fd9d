"""Expert parallelism for transformers' mixture-of-experts layers, dropless.

transformers' experts modules (Mixtral's ``MixtralExperts`` and its kind) hold every
expert's weights stacked along dim 0 and are called as ``experts(hidden (tokens, d),
top_k_index (tokens, k), top_k_weights (tokens, k))``. ``expert_parallel_`` keeps rank s of
the ep group's experts [s*E/ep, (s+1)*E/ep) and replaces the module's forward: each
*assignment* (a token's choice of an expert) travels to the rank holding its expert (an
all-to-all of the counts, then of the tokens in uneven splits, since nothing caps how many
tokens an expert takes), the module's own forward runs the experts there, one choice per
row with weight 1, and the outputs travel back (backward: the reverse all-to-alls), where
they are weighted and summed per token, as in the one-process model.

Each ep rank sees its own tokens (E+D, ``moe.data_shard``); expert parameters carry
``expert_parallel = True``, so ``moe.reduce_gradients`` and ``moe.zero_arguments`` treat
them as they do the GPT's experts.
"""
from __future__ import annotations

import torch
from torch import nn

import commlib
from commlib_strategies.mappings import all_to_all_uneven
from commlib_strategies.sequence_parallel import rehook_gradient_sums


def expert_parallel_(experts: nn.Module, group: commlib.Communicator) -> None:
    """Make a transformers experts module expert-parallel over ``group``, in place."""
    total = experts.num_experts
    if total % group.size:
        raise ValueError(f"expert parallel: {total} experts do not divide by ep={group.size}; "
                         f"choose an ep dividing {total}")
    local = total // group.size
    first = group.rank * local
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] != total:
            raise ValueError(f"expert parallel: {type(experts).__name__}.{name} is not stacked "
                             f"by expert (shape {tuple(p.shape)}, {total} experts)")
        held = nn.Parameter(p.detach()[first:first + local].clone())
        held.expert_parallel = True
        held.ep_split_dim, held.ep_full_size = 0, total  # (for checkpoints)
        held.summed_over = getattr(p, "summed_over", ())  # context parallel's gradient sums
        setattr(experts, name, held)
    rehook_gradient_sums(experts)
    own_forward = experts.forward
    experts.num_experts = local

    def forward(hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        choice = top_k_index.reshape(-1)
        order = torch.argsort(choice, stable=True)  # assignments by expert, hence by rank
        token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)[order]
        send = torch.bincount(choice[order] // local, minlength=group.size)
        recv = torch.empty_like(send)
        group.all_to_all(recv, send)
        send_rows, recv_rows = send.tolist(), recv.tolist()
        arrived = all_to_all_uneven(hidden[token], group, send_rows, recv_rows)
        with torch.no_grad():
            ids = all_to_all_uneven(choice[order].unsqueeze(1), group, send_rows, recv_rows)
        ones = torch.ones(ids.shape, dtype=top_k_weights.dtype, device=hidden.device)
        out = own_forward(arrived, ids - first, ones)
        back = all_to_all_uneven(out, group, recv_rows, send_rows)
        weight = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, back * weight)
    experts.forward = forward
