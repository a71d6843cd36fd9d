"""Mixture of experts (MoE) in the GPT's MLP slot, and expert parallelism (EP, and E+D).

Vocabulary:

    expert          an MLP (``model.MLP``); a layer holds ``experts`` of them and a *router*,
                    a bias-free linear d_model -> experts followed by a softmax
    assignment      token t's c-th choice (c < topk) of an expert: the top-k of its router
                    probabilities. Its *gate* (weight) is that probability, renormalised over
                    the k choices when k > 1 (with k = 1 the raw probability, so that the LM
                    loss still trains the router)
    routing group   the tokens that compete for an expert's capacity: ``group_rows``
                    consecutive rows (sequences) of the batch the layer is given; the whole
                    batch when ``group_rows`` is None
    capacity        how many assignments an expert accepts from one routing group:
                    ceil(capacity_factor * topk * tokens_in_group / experts). Every token's
                    first choice queues before any second choice, in token order (GShard)
    dropped         an assignment past its expert's capacity: it contributes zero, so a token
                    whose choices are all dropped leaves the layer as zero and goes on through
                    the block's residual unchanged
    aux loss        per routing group, experts * sum_e f_e * P_e (Switch Transformer): f_e the
                    fraction of the group's assignments that chose e (before dropping), P_e
                    the mean router probability of e. 1 when routing is uniform; the layer's
                    is the mean over its groups, the model's the sum over layers

Expert parallelism: rank s of the expert-parallel group ``ep`` holds experts
[s*E/ep, (s+1)*E/ep). Each rank routes its own tokens exactly as the single-process layer
would (same groups, same capacity), sends every kept assignment's token to the rank holding
its expert (an all-to-all of the per-expert counts, then one of the tokens in uneven
splits), runs its experts on what arrives and sends the outputs back the same way; the
backward is the reverse all-to-all. Routing never depends on the layout: a rank's routing
groups are the reference's groups of the same rows, so a single-process run of the global
batch with the same ``group_rows`` routes every token the same way. Choose ``group_rows``
dividing each rank's micro-batch (with it equal to the micro-batch, the usual choice, the
groups are the data-parallel ranks' micro-batches).

E+D, on a mesh of dp x ep (the plumbing in expert_parallel.py): every rank of the grid sees
different data (``data_shard``: shard
dp_rank * ep + ep_rank of dp * ep). ``reduce_gradients`` then averages the dense (non-expert)
parameters' gradients over all dp * ep ranks, and each expert's over the ranks holding a
replica of it (its dp group): the expert's local gradient already sums what the tokens of
every ep rank contributed (they came back through the all-to-all), so it is summed over dp
and divided by dp * ep. Expert parameters carry ``expert_parallel = True``.

Expert tensor parallelism, on a mesh of dp x ep x tp (``ExpertParallelMoE`` with ``tp``):
the tp ranks of one ep rank hold the same tokens and route them alike; each expert is split
over tp as the dense tensor-parallel MLP (``TensorParallelExpert``), the all-to-all runs
among the ranks of one tp index, and the layer's output is summed over tp once at its end
(with Megatron SP: the sequence shards are all-gathered before routing, the output
reduce-scattered). The rest of the model is tensor-parallel by its plan, and the gradients
are reduced as above.

With context parallelism (dp x ep x cp, ``ExpertParallelMoE`` with ``cp``) each rank holds
sequence shards, and a routing group's sequences span the cp ranks: the router's
probabilities are all-gathered over cp, so that every token is kept or dropped as in the
reference (capacity and aux loss are the whole group's), and each rank dispatches only the
assignments of its own tokens. The rest of the model is context-parallel by its plan.

With both tp and cp (dp x ep x tp x cp) the layer does both: it routes as under cp and
runs its experts split over tp.

With pipeline parallelism (a mesh of pp x ...) the ep, dp, tp and cp groups are ranks of
one stage: ``pipeline.PipelineStage`` cuts the model into stages, every
stage's ranks all-to-all among themselves, and the reductions above run within each stage
(ZeRO's dense group is the stage's dp x ep, ``Mesh.joint_group("dp", "ep")``).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib_strategies.mappings import (all_to_all_uneven, copy_to_group, gather_along,
                                         gather_for_partial, reduce_from_group,
                                         reduce_scatter_along)
from commlib_strategies.model import GPT, MLP, init_normal_
from commlib_strategies.sequence_parallel import sum_gradients, sum_replicated_gradients
from commlib_strategies.tensor_parallel import ColumnParallelLinear, RowParallelLinear


@dataclass
class Routing:
    """The kept assignments of one forward, sorted by expert (token order within one)."""
    token: torch.Tensor   # (kept,) index of the assignment's token among the flattened tokens
    gate: torch.Tensor    # (kept,) its weight
    counts: list          # kept assignments per expert
    aux_loss: torch.Tensor
    dropped: int          # assignments past capacity


class Experts(nn.ModuleDict):
    """A layer's experts (held here), by global index. Called once per forward on every
    rank, whatever arrives (ZeRO 3 gathers them when they are called)."""

    def forward(self, inputs, counts):
        """Rows sorted by expert, ``counts[j]`` of them for the j-th expert held here ->
        each row through its expert, in the same order."""
        chunks = inputs.split(counts)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.values(), chunks)])


class MoE(nn.Module):
    """A drop-in for ``model.MLP``: (..., d_model) -> (..., d_model), routing each token to its
    top-k experts. After a forward, ``aux_loss`` holds its load-balancing loss and
    ``dropped`` how many assignments capacity refused."""

    def __init__(self, d_model: int, hidden: int, experts: int, topk: int = 2,
                 capacity_factor: float = 1.25, group_rows: int | None = None):
        super().__init__()
        sizes = {"d_model": d_model, "hidden": hidden, "experts": experts, "topk": topk}
        if group_rows is not None:
            sizes["group_rows"] = group_rows
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if topk > experts:
            raise ValueError(f"MoE: topk={topk} exceeds experts={experts}; a token chooses "
                             f"topk different experts, so choose topk <= experts")
        if not capacity_factor > 0:  # also refuses NaN
            raise ValueError(f"MoE: capacity_factor must be positive, got {capacity_factor!r}")
        self.d_model, self.num_experts, self.topk = d_model, experts, topk
        self.capacity_factor, self.group_rows = capacity_factor, group_rows
        self.router = nn.Linear(d_model, experts, bias=False)
        # keyed by the expert's global index, so an expert-parallel rank's names are a
        # subset of the single-process layer's
        self.experts = Experts({str(e): MLP(d_model, hidden) for e in range(experts)})
        self._mark_experts()
        self.aux_loss, self.dropped = None, 0

    def _mark_experts(self):
        # for code outside this module; a deepcopy of a parameter drops its attributes, so
        # this module itself tells experts apart by where they live (expert_parameters)
        for p in self.experts.parameters():
            p.expert_parallel = True

    def __getstate__(self):
        # the last aux loss belongs to that forward's graph, which deepcopy cannot copy
        return {**self.__dict__, "aux_loss": None}

    def forward(self, x):
        self._check_input(x)
        return self._mix(x, self.route(x))

    def _mix(self, x, routing: Routing):
        """Every kept assignment's token of ``x`` through its expert, weighted by its gate,
        summed per token (x's shape); records the routing's aux loss and drops."""
        self.aux_loss, self.dropped = routing.aux_loss, routing.dropped
        tokens = x.reshape(-1, self.d_model)
        out = self._run_experts(tokens[routing.token], routing.counts)
        weighted = out * routing.gate.to(out.dtype).unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, routing.token, weighted).view(x.shape)

    def _check_input(self, x):
        if x.dim() < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: expected input (rows, ..., {self.d_model}), got "
                             f"{tuple(x.shape)}")

    def capacity(self, tokens_in_group: int) -> int:
        return math.ceil(self.capacity_factor * self.topk * tokens_in_group / self.num_experts)

    def route(self, x) -> Routing:
        return self.assign(self.probabilities(x))

    def probabilities(self, x):
        """The router's probabilities (..., experts) of tokens ``x`` (..., d_model)."""
        logits = self.router(x)
        # routing in at least fp32: bf16 probabilities would tie and reorder choices
        return F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def assign(self, probs) -> Routing:
        """The routing of tokens whose router probabilities are ``probs`` (rows, ...,
        experts): top-k, capacity within each routing group, the aux loss."""
        rows, experts, k = probs.shape[0], self.num_experts, self.topk
        group_rows = rows if self.group_rows is None else self.group_rows
        if rows % group_rows:
            raise ValueError(f"MoE: a batch of {rows} rows does not split into routing groups "
                             f"of group_rows={group_rows}; use a batch (per rank) that is a "
                             f"multiple of group_rows")
        groups = rows // group_rows
        probs = probs.reshape(groups, -1, experts)
        per_group = probs.shape[1]
        top_p, top_e = probs.topk(k, dim=-1)                               # (G, n, k)
        gate = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
        chosen = F.one_hot(top_e, experts)                                 # (G, n, k, E)
        # each assignment's place in its expert's queue: all first choices, then all second
        queue = chosen.transpose(1, 2).reshape(groups, k * per_group, experts)
        place = ((queue.cumsum(1) - 1) * queue).sum(-1)
        place = place.view(groups, k, per_group).transpose(1, 2)            # (G, n, k)
        kept = (place < self.capacity(per_group)).flatten()
        fraction = chosen.sum((1, 2)).to(probs.dtype) / (per_group * k)    # (G, E)
        aux_loss = experts * (fraction * probs.mean(1)).sum(-1).mean()
        # flattened assignments are (token, choice) in token order; keep, then sort by expert
        index = kept.nonzero().squeeze(-1)
        expert = top_e.flatten()[index]
        order = torch.argsort(expert, stable=True)
        index = index[order]
        return Routing(token=index // k, gate=gate.flatten()[index],
                       counts=torch.bincount(expert, minlength=experts).tolist(),
                       aux_loss=aux_loss, dropped=int(kept.numel() - index.numel()))

    def _run_experts(self, inputs, counts):
        return self.experts(inputs, counts)

    def extra_repr(self):
        return (f"experts={self.num_experts}, topk={self.topk}, "
                f"capacity_factor={self.capacity_factor}, group_rows={self.group_rows}")


class TensorParallelExpert(nn.Module):
    """An expert MLP split over ``tp`` as the dense tensor-parallel MLP is: fc1
    column-parallel, fc2 row-parallel. Takes rows replicated over tp and gives their outputs
    partial over tp: the MoE layer sums the combined outputs once."""
    # zero-bubble's W runs backward from each module's output to its parameters; this
    # module applies its linears' weights itself (pipeline.py)
    unsplittable = "experts split over tp (their weights applied by the expert)"

    def __init__(self, mlp: MLP, tp: commlib.Communicator):
        super().__init__()
        self.tp = tp
        self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, tp)
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, tp, input_is_parallel=True)

    def forward(self, x):
        hidden = F.gelu(F.linear(x, self.fc1.weight, self.fc1.bias))
        # each rank adds 1/tp of the bias, so the layer's sum over tp adds it once;
        # copy_to_group makes the bias's gradient the sum of the ranks' shares
        bias = copy_to_group(self.fc2.bias, self.tp) / self.tp.size
        return F.linear(hidden, self.fc2.weight) + bias


class ExpertParallelMoE(MoE):
    """A MoE layer holding experts/ep of the experts; tokens travel to their experts and back
    by all-to-all over ``group`` (the ep group). Made from a single-process ``MoE``.

    With ``tp`` (expert tensor parallelism): the tp ranks hold the same tokens and route them
    alike (the router replicated), each expert is a ``TensorParallelExpert``, the
    all-to-all runs among the ranks of one tp index, and the layer's output is summed over
    tp once at the end, where the dense tensor-parallel MLP sums its own. With
    ``sequence_parallel`` (Megatron SP on tp) the layer takes and gives sequence shards
    (rows, time/tp, d_model): the router runs on the shard (its gradient summed over tp by a
    hook, as LayerNorm's), the probabilities and the tokens are all-gathered along time
    before routing, and the output is reduce-scattered along time.

    With ``cp`` (context parallelism) the layer takes this rank's sequence shards (rows,
    time/cp, d_model) and a routing group spans the cp ranks: the router's probabilities
    (small) are all-gathered along time, every cp rank routes the whole groups as the
    single-process layer does (capacity, aux loss), and keeps the assignments of its own
    tokens, which alone it dispatches. Every parameter is then used on a shard: the model
    sums their gradients over cp (``sequence_parallel.sum_gradients``). With ``tp`` as well
    the layer routes as under cp, and runs its experts split over tp as above (without
    ``sequence_parallel``: cp already shards the sequences)."""

    def __init__(self, moe: MoE, group: commlib.Communicator,
                 tp: commlib.Communicator | None = None, sequence_parallel: bool = False,
                 cp: commlib.Communicator | None = None):
        nn.Module.__init__(self)
        if moe.num_experts % group.size:
            raise ValueError(f"expert parallel: experts={moe.num_experts} is not divisible by "
                             f"ep={group.size}; choose a multiple of {group.size} experts")
        if sequence_parallel and tp is None:
            raise ValueError("expert parallel: sequence_parallel shards the sequences over "
                             "the tp group; pass tp")
        if sequence_parallel and cp is not None:
            raise ValueError("expert parallel: sequence_parallel shards the sequences over "
                             "tp, cp shards them over cp; pass one of them")
        for name in ("d_model", "num_experts", "topk", "capacity_factor", "group_rows"):
            setattr(self, name, getattr(moe, name))
        self.group, self.tp, self.sequence_parallel = group, tp, sequence_parallel
        self.cp = cp
        self.local = moe.num_experts // group.size
        first = group.rank * self.local
        self.router = copy.deepcopy(moe.router)

        def held(expert):
            return copy.deepcopy(expert) if tp is None else TensorParallelExpert(expert, tp)
        self.experts = Experts({str(e): held(moe.experts[str(e)])
                                for e in range(first, first + self.local)})
        self._mark_experts()
        if sequence_parallel:
            sum_replicated_gradients(self.router, tp)
        if cp is not None:  # every parameter is used on sequence shards
            sum_gradients(self, cp)
        self.aux_loss, self.dropped = None, 0

    def forward(self, x):
        self._check_input(x)
        tp = self.tp
        if self.cp is not None:
            probs = gather_along(self.probabilities(x), self.cp, 1)
            routing = self._own_tokens(self.assign(probs), x.shape[1])
        elif self.sequence_parallel:
            probs = gather_along(self.probabilities(x), tp, 1)
            x = gather_for_partial(x, tp, 1)
            routing = self.assign(probs)
        else:
            routing = self.route(x)
        if tp is None:
            return self._mix(x, routing)
        if not self.sequence_parallel:
            x = copy_to_group(x, tp)  # the experts' outputs are partial: so are x's gradients
        # the gates scale partial outputs: their gradients are partial too
        routing.gate = copy_to_group(routing.gate, tp)
        y = self._mix(x, routing)
        return reduce_scatter_along(y, tp, 1) if self.sequence_parallel else \
            reduce_from_group(y, tp)

    def _own_tokens(self, routing: Routing, shard: int) -> Routing:
        """The assignments of ``routing`` (of whole sequences, gathered over cp) whose tokens
        are this rank's: time [cp_rank * shard, (cp_rank + 1) * shard) of each sequence,
        indexed among this rank's tokens. The aux loss and drops stay the groups'."""
        start, time = self.cp.rank * shard, shard * self.cp.size
        row, t = routing.token // time, routing.token % time
        mine = (t >= start) & (t < start + shard)
        return Routing(token=(row * shard + t - start)[mine], gate=routing.gate[mine],
                       counts=[int(m.sum()) for m in mine.split(routing.counts)],
                       aux_loss=routing.aux_loss, dropped=routing.dropped)

    def _run_experts(self, inputs, counts):
        ranks, local = self.group.size, self.local
        send = torch.tensor(counts, dtype=torch.int64).view(ranks, local)
        recv = torch.empty_like(send)   # recv[s, j]: rows rank s sends to my j-th expert
        self.group.all_to_all(recv, send)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = all_to_all_uneven(inputs, self.group, send_rows, recv_rows)
        # rows arrive by source rank, then expert; the experts want them by expert, then source
        place = torch.arange(ranks * local).view(local, ranks).t()  # of segment (s, j), by expert
        order = torch.argsort(place.flatten().repeat_interleave(recv.flatten()), stable=True)
        out = MoE._run_experts(self, arrived[order], recv.sum(0).tolist())
        return all_to_all_uneven(out[torch.argsort(order)], self.group, recv_rows, send_rows)

    def extra_repr(self):
        first = int(next(iter(self.experts)))
        return (super().extra_repr() + f", holding experts {first}..{first + self.local - 1} "
                f"of ep={self.group.size}"
                + (f", split over tp={self.tp.size}" if self.tp is not None else "")
                + (", sequence parallel" if self.sequence_parallel else "")
                + (f", sequence shards of cp={self.cp.size}" if self.cp is not None else ""))


# ------------------------------------------------------------------------------ the GPT

def moe_gpt(reference: GPT, *, experts: int, topk: int = 2, capacity_factor: float = 1.25,
            group_rows: int | None = None, aux_weight: float = 0.01, seed: int = 0) -> GPT:
    """A copy of ``reference`` whose blocks' MLPs are MoE layers drawn from ``seed`` (the
    same arguments give the same model in every process); its ``loss`` adds ``aux_weight``
    times the sum of the layers' aux losses (model.LanguageModel)."""
    if not aux_weight >= 0:
        raise ValueError(f"moe_gpt: aux_weight must be non-negative, got {aux_weight!r}")
    config = reference.config
    model = copy.deepcopy(reference)
    model.aux_weight = aux_weight
    with torch.random.fork_rng(devices=[]):  # building draws nothing from the global RNG
        for block in model.blocks:
            block.mlp = MoE(config.d_model, config.mlp_ratio * config.d_model, experts, topk,
                            capacity_factor, group_rows)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:  # in a fixed order: the same draws every time
            for module in block.mlp.modules():
                if isinstance(module, nn.Linear):
                    init_normal_(module.weight, 0.02, generator)
                    if module.bias is not None:
                        module.bias.zero_()
    return model
