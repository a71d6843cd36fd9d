"""Tensor parallelism (Megatron-style): each rank of a tp group holds a slice of every large
weight and computes its part of each layer; the mappings stitch the parts together.

Vocabulary as in ``mappings``: *replicated*, *partial*, *split along dim*. A model is made
tensor-parallel in place, where its plan says (parallelize.py), its parameters keeping their
names:

    column_parallel_       a linear keeps output features [r*out/tp, (r+1)*out/tp) (of each
                           fused part); replicated in, split out
    row_parallel_          a linear keeps input features [r*in/tp, ...); split in,
                           replicated out
    vocab_parallel_        an embedding keeps vocab rows [r*V/tp, ...); ids in, replicated out

The layers ``ColumnParallelLinear`` (split or, with gather_output, replicated out) and
``RowParallelLinear`` do the same as modules of their own (a mixture-of-experts layer's
tensor-parallel experts, moe.py).

A transformer block needs two reductions forward and two backward: attention's q/k/v are
column-parallel (a rank keeps whole heads) feeding a row-parallel proj, and the MLP's fc1 is
column-parallel feeding a row-parallel fc2. The LM head is column-parallel over the vocab and
its loss, ``vocab_parallel_cross_entropy``, never gathers the full logits.

Parameters that every rank of the group holds whole (LayerNorms, the position embedding,
row-parallel biases) are used on replicated inputs, so each rank computes the same full
gradient for them and they stay identical without any extra communication. Those used on
split activations (a norm over each attention head, as Qwen3's q_norm, sees only this
rank's heads) get part of their gradient on each rank: parallelize sums it over tp
(sequence_parallel.sum_gradient_over), where the plan names them (``tp_summed``).

Vocab sizes that do not divide by tp are padded up to a multiple of tp: the padded embedding
rows and head rows are zero, no valid token id looks a padded row up, and the loss masks the
padded logits to -inf, so padding changes neither values nor gradients. Each sharded
parameter carries ``tp_split_dim`` (the dim it is split along) and ``tp_full_size`` (the
unpadded size of that dim), which ``gathered_state`` uses to rebuild the full tensors.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib_strategies.megatron_sp import gathered_matmul
from commlib_strategies.mappings import (copy_to_group, gather_along, reduce_from_group,
                                         reduce_scatter_along, split_along)


def _check_divides(total: int, group: commlib.Communicator, what: str) -> None:
    if total % group.size:
        raise ValueError(f"{what}={total} is not divisible by tp={group.size}; "
                         f"choose a multiple of {group.size}")


def _shard(full: torch.Tensor, group: commlib.Communicator, dim: int) -> torch.Tensor:
    return full.detach().chunk(group.size, dim)[group.rank].clone()


def _mark(param: nn.Parameter, dim: int, full_size: int) -> nn.Parameter:
    param.tp_split_dim, param.tp_full_size = dim, full_size
    return param


def padded_size(size: int, group: commlib.Communicator) -> int:
    """``size`` rounded up to a multiple of the group's size."""
    return -(-size // group.size) * group.size


# ------------------------------------------------------------------------------ layers

class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows (and b) split over the group.

    The input is replicated; ``copy_to_group`` makes its gradient the sum of every rank's
    part. The output is split along the last dim, or all-gathered when ``gather_output``.
    A fresh layer holds this rank's slice of an ``nn.Linear(in, out)`` drawn from the global
    RNG, so ranks with the same RNG state hold slices of one consistent layer.
    """

    def __init__(self, in_features: int, out_features: int, group: commlib.Communicator, *,
                 bias: bool = True, gather_output: bool = False):
        super().__init__()
        _check_divides(out_features, group, "out_features")
        full = nn.Linear(in_features, out_features, bias=bias)
        self._load(full.weight, full.bias, group, gather_output, out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: commlib.Communicator, *,
                    gather_output: bool = False):
        """This rank's slice of ``linear``."""
        return cls._from_full(linear.weight, linear.bias, group, gather_output)

    @classmethod
    def _from_full(cls, weight, bias, group, gather_output, full_size=None):
        """From the full weight (out, in) and bias; ``full_size``: the rows not padding."""
        _check_divides(weight.shape[0], group, "out_features")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._load(weight, bias, group, gather_output,
                    weight.shape[0] if full_size is None else full_size)
        return layer

    def _load(self, weight, bias, group, gather_output, full_size):
        self.group, self.gather_output = group, gather_output
        self.out_features, self.in_features = weight.shape
        self.weight = _mark(nn.Parameter(_shard(weight, group, 0)), 0, full_size)
        self.bias = None if bias is None else _mark(nn.Parameter(_shard(bias, group, 0)), 0,
                                                    full_size)

    def forward(self, x):
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_along(y, self.group, -1) if self.gather_output else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}/{self.group.size}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over the group and b held whole.

    The input is split along the last dim (``input_is_parallel``), else replicated and split
    here. Each rank's product is a partial sum; ``reduce_from_group`` adds them, and then the
    bias is added once, so it is not counted tp times.
    """

    def __init__(self, in_features: int, out_features: int, group: commlib.Communicator, *,
                 bias: bool = True, input_is_parallel: bool = False):
        super().__init__()
        _check_divides(in_features, group, "in_features")
        self._load(nn.Linear(in_features, out_features, bias=bias), group, input_is_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: commlib.Communicator, *,
                    input_is_parallel: bool = False):
        _check_divides(linear.in_features, group, "in_features")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._load(linear, group, input_is_parallel)
        return layer

    def _load(self, linear, group, input_is_parallel):
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _mark(nn.Parameter(_shard(linear.weight, group, 1)), 1, linear.in_features)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())  # replicated

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_along(x, self.group, -1)
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in={self.in_features}/{self.group.size}, out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    padded = weight.detach().new_zeros((rows,) + weight.shape[1:])
    padded[:weight.shape[0]] = weight.detach()
    return padded


# ------------------------------------------------------------------------------ the loss

def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 group: commlib.Communicator,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits split along the vocab (last) dim, without gathering them.

    ``local_logits`` (..., V/tp) is rank r's slice [r*V/tp, (r+1)*V/tp) of the logits;
    ``targets`` (...) are global ids, the same on every rank. ``vocab_size``: the real vocab
    when V was padded; logits of the padded ids are ignored (as if -inf). Computed in at
    least fp32; the result is replicated over the group, and the gradient flows to the local
    logits (softmax minus one-hot, on this rank's slice).
    """
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, group, vocab_size):
        rows = local_logits.shape[-1]
        start = group.rank * rows
        vocab_size = rows * group.size if vocab_size is None else vocab_size
        if targets.numel() and not 0 <= int(targets.min()) <= int(targets.max()) < vocab_size:
            raise ValueError(f"targets must lie in [0, {vocab_size}), got "
                             f"[{int(targets.min())}, {int(targets.max())}]")
        dtype = torch.promote_types(local_logits.dtype, torch.float32)
        x = local_logits.detach().to(dtype).reshape(-1, rows)
        padding = torch.arange(start, start + rows, device=x.device) >= vocab_size
        x = x.masked_fill(padding, float("-inf"))
        # stabilise with the global max: a constant per row, so no gradient flows through it
        shift = x.max(-1).values.contiguous()
        group.all_reduce(shift, op="max")
        x = x - shift.unsqueeze(-1)
        exp = x.exp()
        sum_exp = exp.sum(-1).contiguous()
        group.all_reduce(sum_exp)
        # the target's logit: the rank that holds its row contributes it, the others zero
        local = targets.reshape(-1) - start
        mine = (local >= 0) & (local < rows)
        local = local.masked_fill(~mine, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        group.all_reduce(picked)
        loss = (sum_exp.log() - picked).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        ctx.logits_shape, ctx.logits_dtype = local_logits.shape, local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        rows_here = mine.nonzero().squeeze(-1)
        g[rows_here, local[rows_here]] -= 1.0
        g *= grad / g.shape[0]
        return g.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None


# ------------------------------------------------------------------------------ in place

def plain_lookup(embedding: nn.Module) -> bool:
    """Whether ``embedding`` is nn.Embedding's own lookup (no forward of its own, no
    max_norm, scale_grad_by_freq or sparse gradients): what vocab_parallel_ splits."""
    return isinstance(embedding, nn.Embedding) and \
        type(embedding).forward is nn.Embedding.forward and embedding.max_norm is None \
        and not embedding.scale_grad_by_freq and not embedding.sparse


def vocab_parallel_(embedding: nn.Embedding, group: commlib.Communicator) -> None:
    """Make an embedding vocab-parallel in place: it keeps this rank's rows of the vocab
    (padded to a multiple of tp with zero rows) and its forward sums every rank's partial
    lookup (ids outside this rank's rows give zeros here); its padding row, on the rank
    that holds it, still gets no gradient."""
    if not plain_lookup(embedding):
        raise ValueError(f"tensor parallel: {type(embedding).__name__} is not a plain "
                         "nn.Embedding lookup (its own forward, max_norm, scale_grad_by_freq "
                         "or sparse); leave it out of the plan's vocab")
    full = embedding.weight.shape[0]
    padded = _pad_rows(embedding.weight, padded_size(full, group))
    embedding.weight = _mark(nn.Parameter(_shard(padded, group, 0)), 0, full)
    rows = padded.shape[0] // group.size
    start = group.rank * rows
    pad = embedding.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + rows else None

    def forward(self, ids):
        local = ids - start
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, pad)
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), group)
    embedding.forward = types.MethodType(forward, embedding)  # (a deep copy rebinds it)


def _out_dim(module: nn.Module) -> int:
    """The weight dim of output features: nn.Linear's (out, in) or transformers' Conv1D's
    (in, out), which GPT-2 uses."""
    if isinstance(module, nn.Linear):
        return 0
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return 1
    raise TypeError(f"tensor parallel: {type(module).__name__} is not a linear layer "
                    "(nn.Linear or transformers' Conv1D); leave it out of the plan")


def _matmul(x: torch.Tensor, weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    return F.linear(x, weight) if out_dim == 0 else x @ weight


def _slice_parts(full: torch.Tensor, dim: int, parts: int, group) -> torch.Tensor:
    """This rank's slice of each of ``parts`` equal parts of ``full`` along ``dim`` (a fused
    projection such as GPT-2's q|k|v), concatenated."""
    chunks = full.detach().chunk(parts, dim)
    return torch.cat([_shard(c, group, dim) for c in chunks], dim)


def column_parallel_(module: nn.Module, group: commlib.Communicator, parts: int = 1,
                     gathered: bool = False, pad: bool = False,
                     gather_output: bool = False) -> None:
    """Make a linear layer column-parallel in place: it keeps this rank's output features
    (of each of ``parts`` fused parts) and its forward takes a replicated input (or, with
    ``gathered``, one Megatron SP all-gathered already, whose backward sums the partial
    gradients) and gives this rank's split output (with ``gather_output``, the whole output,
    gathered: for a module whose users need every feature, such as a fused q|k|v whose
    attention is not split by heads). Its parameters keep their names. With ``pad`` (an LM
    head over a vocab tp does not divide) the outputs are padded with zero rows up to a
    multiple of tp."""
    dim = _out_dim(module)
    full = module.weight.shape[dim]

    def sliced(t, d):
        if pad:
            t = _pad_rows(t.movedim(d, 0), padded_size(full, group)).movedim(0, d)
        return _mark(nn.Parameter(_slice_parts(t, d, parts, group)), d, full)
    if full % (parts * group.size) and not pad:
        raise ValueError(f"tensor parallel: {full} output features in {parts} part(s) do not "
                         f"divide by tp={group.size}; choose a tp dividing {full // parts}")
    module.weight = sliced(module.weight, dim)
    module.weight.tp_parts = parts
    if module.bias is not None:
        module.bias = sliced(module.bias, 0)
        module.bias.tp_parts = parts

    def forward(self, x):
        y = gathered_matmul(x, self.weight, dim) if gathered else \
            _matmul(copy_to_group(x, group), self.weight, dim)
        y = y if self.bias is None else y + self.bias
        return gather_along(y, group, -1) if gather_output else y
    module.forward = types.MethodType(forward, module)  # (a deep copy rebinds it)


def column_parameter_(owner: nn.Module, name: str, group: commlib.Communicator) -> None:
    """Keep this rank's part of ``owner``'s bare parameter ``name`` along its first dim,
    one entry per attention head (as a column-parallel projection keeps its heads)."""
    full = getattr(owner, name)
    if full.shape[0] % group.size:
        raise ValueError(f"tensor parallel: {type(owner).__name__}.{name} has {full.shape[0]} "
                         f"entries (one per head), which do not divide by tp={group.size}")
    setattr(owner, name, _mark(nn.Parameter(_shard(full, group, 0),
                                            requires_grad=full.requires_grad), 0, full.shape[0]))


def row_parallel_(module: nn.Module, group: commlib.Communicator,
                  sequence_dim: int | None = None, split_input: bool = False) -> None:
    """Make a linear layer row-parallel in place: it keeps this rank's input features and
    its forward takes a split input (a column-parallel layer's output; with
    ``split_input``, the whole input, which it splits) and gives the replicated output (or,
    with ``sequence_dim``, Megatron SP's sequence shard of it, reduce-scattered along that
    dim), the bias (held whole) added once after the sum."""
    out = _out_dim(module)
    dim = 1 - out
    full = module.weight.shape[dim]
    if full % group.size:
        raise ValueError(f"tensor parallel: {full} input features do not divide by "
                         f"tp={group.size}; choose a tp dividing {full}")
    module.weight = _mark(nn.Parameter(_slice_parts(module.weight, dim, 1, group)), dim, full)

    def forward(self, x):
        partial = _matmul(split_along(x, group, -1) if split_input else x, self.weight, out)
        y = reduce_from_group(partial, group) if sequence_dim is None else \
            reduce_scatter_along(partial, group, sequence_dim)
        return y if self.bias is None else y + self.bias
    module.forward = types.MethodType(forward, module)  # (a deep copy rebinds it)


@torch.no_grad()
def gathered_state(module: nn.Module, group: commlib.Communicator, *,
                   grads: bool = False) -> dict:
    """name -> the full (unsharded, unpadded) parameter, or its gradient with ``grads``,
    on every rank. Collective: every rank of the group must call it."""
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        t = t.detach()
        dim = getattr(p, "tp_split_dim", None)
        if dim is not None:
            t = gather_along(t, group, dim)
            parts = getattr(p, "tp_parts", 1)
            if parts > 1:  # rank-major (r0's parts, r1's, ...) to part-major
                shape = t.shape[:dim] + (group.size, parts, -1) + t.shape[dim + 1:]
                t = t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)
            t = t.narrow(dim, 0, p.tp_full_size)
        out[name] = t.clone()
    return out
