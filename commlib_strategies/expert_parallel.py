"""Expert parallelism: the data and gradient plumbing of E+D (dp x ep) for any model with
experts (the GPT's MoE layers, moe.py, or a transformers model's), and transformers'
mixture-of-experts layers made expert-parallel, dropless.

The plumbing: ``data_shard`` gives every dp x ep rank its own rows; ``reduce_gradients``
averages dense gradients over dp x ep and experts' over their replicas (dp);
``zero_arguments`` gives ZeRO the same split; ``gathered_state`` every expert on every rank.

``expert_parallel_`` applies expert parallelism where a plan says: the project's MoE layers
become moe.ExpertParallelMoE. transformers' experts modules (Mixtral's ``MixtralExperts``
and its kind) hold every expert's weights stacked along dim 0 and are called as
``experts(hidden (tokens, d), top_k_index (tokens, k), top_k_weights (tokens, k))``; each
keeps rank s of the ep group's experts [s*E/ep, (s+1)*E/ep) and replaces the module's
forward: each
*assignment* (a token's choice of an expert) travels to the rank holding its expert (an
all-to-all of the counts, then of the tokens in uneven splits, since nothing caps how many
tokens an expert takes), the module's own forward runs the experts there, one choice per
row with weight 1, and the outputs travel back (backward: the reverse all-to-alls), where
they are weighted and summed per token, as in the one-process model.

Each ep rank sees its own tokens (``data_shard``); expert parameters carry
``expert_parallel = True``, so ``reduce_gradients`` and ``zero_arguments`` treat them as
they do the GPT's experts.
"""
from __future__ import annotations

import types

import torch
from torch import nn

import commlib
from commlib_strategies.data import shard
from commlib_strategies.mappings import all_to_all_uneven, gather_along
from commlib_strategies.mesh import Mesh
from commlib_strategies.moe import ExpertParallelMoE, MoE
from commlib_strategies.sequence_parallel import rehook_gradient_sums
from commlib_strategies.zero import default_units


def expert_parallel_(model: nn.Module, layers: list, mesh: Mesh, sp: str | None = None) -> None:
    """Make ``model``'s mixture-of-experts ``layers`` (their names) expert-parallel over
    the mesh's ep group, in place: the project's ``MoE`` layers are replaced by
    ``ExpertParallelMoE`` (on a mesh with tp or cp too: split over tp, on cp's or, with
    ``sp="megatron"``, Megatron SP's sequence shards), transformers' experts modules split
    by expert (whole under tp: each tp rank computes them)."""
    tp, cp, ep = (mesh.group(d) if mesh.size(d) > 1 else None for d in ("tp", "cp", "ep"))
    for name in layers:
        layer = model.get_submodule(name)
        if isinstance(layer, MoE):
            if tp or cp or ep:
                megatron = sp == "megatron" and tp is not None
                model.set_submodule(name, ExpertParallelMoE(
                    layer, mesh.group("ep"), tp=tp, sequence_parallel=megatron, cp=cp))
        elif ep:
            _split_stacked(layer, ep)


def _split_stacked(experts: nn.Module, group: commlib.Communicator) -> None:
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
    own_forward = type(experts).forward
    experts.num_experts = local

    def forward(self, hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        choice = top_k_index.reshape(-1)
        order = torch.argsort(choice, stable=True)  # assignments by expert, hence by rank
        token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)[order]
        # per (rank, its j-th expert): how many rows go there; recv[s, j]: arrive from s
        send = torch.bincount(choice, minlength=total).view(group.size, local)
        recv = torch.empty_like(send)
        group.all_to_all(recv, send)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = all_to_all_uneven(hidden[token], group, send_rows, recv_rows)
        # rows arrive by source, each source's by expert: the counts say whose each is
        ids = torch.arange(local, device=hidden.device).repeat(group.size) \
            .repeat_interleave(recv.flatten().to(hidden.device)).unsqueeze(1)
        ones = torch.ones(ids.shape, dtype=top_k_weights.dtype, device=hidden.device)
        out = own_forward(self, arrived, ids, ones)
        back = all_to_all_uneven(out, group, recv_rows, send_rows)
        weight = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, back * weight)
    experts.forward = types.MethodType(forward, experts)  # (a deep copy rebinds it)


# ------------------------------------------------------------------ E+D plumbing

def zero_arguments(model: nn.Module, mesh: Mesh) -> dict:
    """ZeRO's ``group``, ``units`` and ``unit_groups`` for an expert-parallel GPT (or a
    pipeline stage of one) on a mesh of dp x ep (x pp, or x tp: each tp rank's ZeRO holds
    its slices). Dense parameters are sharded over the dp x ep ranks (of the stage), which
    all hold them and saw different data; each MoE layer's experts form a unit of their
    own, sharded over their replicas (the dp group); stage 3 gathers it when the layer
    calls its ``Experts``, which every rank does in every forward. Units never span two
    blocks, so a pipeline can reduce each piece's units on their own. The gradients are
    then the ones ``reduce_gradients`` makes."""
    units, unit_groups = [], {}

    experts = expert_parameters(model)

    def split(unit):  # a unit holding experts and more: its children, the experts apart
        held = [id(p) in experts for p in unit.parameters()]
        if all(held):
            units.append(unit)
            unit_groups[unit] = mesh.group("dp")
        elif not any(held):
            units.append(unit)
        else:
            for child in unit.children():
                if any(True for _ in child.parameters()):
                    split(child)

    for unit in default_units(model):
        split(unit)
    return {"group": mesh.joint_group("dp", "ep"), "units": units, "unit_groups": unit_groups}


def data_shard(tensor: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's rows of a global batch: shard dp_rank * ep + ep_rank of dp * ep."""
    ep = mesh.size("ep")
    return shard(tensor, mesh.rank("dp") * ep + mesh.rank("ep"), mesh.size("dp") * ep)


def expert_parameters(model: nn.Module) -> set:
    """ids of the parameters of every MoE layer's experts in ``model``, and of those
    marked ``expert_parallel`` (a transformers model's, expert_parallel.py)."""
    return {id(p) for layer in model.modules() if isinstance(layer, MoE)
            for p in layer.experts.parameters()} | \
        {id(p) for p in model.parameters() if getattr(p, "expert_parallel", False)}


@torch.no_grad()
def reduce_gradients(model: nn.Module, mesh: Mesh) -> None:
    """After backward on each rank's ``data_shard``: make every gradient the gradient of the
    mean loss over the global batch. Dense ones: averaged over the dp x ep ranks; expert
    ones: summed over dp, divided by dp * ep. Collective over the mesh."""
    experts = expert_parameters(model)
    dense, expert = [], []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # every rank must contribute to the same reductions
                p.grad = torch.zeros_like(p)
            (expert if id(p) in experts else dense).append(p)
    ranks = mesh.size("dp") * mesh.size("ep")
    _sum_flat(dense, [mesh.group("ep"), mesh.group("dp")], ranks)
    _sum_flat(expert, [mesh.group("dp")], ranks)


def _sum_flat(params, groups, divisor):
    """Sum the gradients of ``params`` over each group in turn (one flat buffer per dtype),
    then divide by ``divisor``."""
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for same in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in same])
        for group in groups:
            if group.size > 1:
                group.all_reduce(flat)
        flat /= divisor
        for p, g in zip(same, flat.split([p.numel() for p in same])):
            p.grad.copy_(g.view_as(p))


@torch.no_grad()
def gathered_state(model: nn.Module, group: commlib.Communicator, *, grads: bool = False,
                   tp: commlib.Communicator | None = None) -> dict:
    """name -> parameter (or gradient, with ``grads``) under the single-process model's names,
    every expert of every layer gathered over ``group`` (the ep group), and with ``tp`` every
    tensor-parallel slice joined over it, on every rank. Collective over the groups."""
    def whole(p):
        t = (p.grad if grads else p).detach()
        dim = getattr(p, "tp_split_dim", None)
        if tp is not None and dim is not None:
            t = gather_along(t, tp, dim).narrow(dim, 0, p.tp_full_size)
        return t

    held = {id(p) for layer in model.modules() if isinstance(layer, ExpertParallelMoE)
            for p in layer.experts.parameters()}
    out = {}
    for name, p in model.named_parameters():
        if id(p) not in held:
            out[name] = whole(p).clone()
    for prefix, layer in model.named_modules():
        if isinstance(layer, ExpertParallelMoE):
            for j, expert in enumerate(layer.experts.values()):
                for name, p in expert.named_parameters():
                    t = whole(p).contiguous()
                    everyone = t.new_empty((group.size,) + t.shape)
                    group.all_gather(everyone, t)
                    for rank in range(group.size):
                        index = rank * layer.local + j
                        out[".".join(filter(None, [prefix, "experts", str(index), name]))] = \
                            everyone[rank]
    return out
