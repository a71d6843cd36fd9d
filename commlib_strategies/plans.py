"""Per-family plans: where each kind of parallelism applies to a model, by module name.

A plan names modules with fnmatch patterns over the model's ``named_modules()`` ("*"
matches dots too), the way torch's ``parallelize_module`` takes a name -> style map, so a
plan for a new family is a short declaration:

    column     {pattern: parts}: linears made column-parallel (``parts``: a fused projection
               such as GPT-2's q|k|v, each part split on its own)
    row        patterns of linears made row-parallel (they take a column-parallel output)
    column_gather, row_split
               patterns of linears made column-parallel with their output gathered whole,
               and row-parallel splitting a whole input: the layers between keep every
               feature (Phi-3's fused q|k|v, whose attention reads the config's head
               counts); with them on the attention, ``heads_split`` is False: every tp rank
               computes every head
    column_params
               patterns of bare parameters (no module of their own) that hold one entry per
               attention head, such as attention sinks: tensor parallelism keeps this
               rank's heads' entries (their first dim split as the heads are)
    tp_summed  patterns of modules kept whole under tensor parallelism that see only this
               rank's part of their input (a norm over each attention head, such as Qwen3's
               q_norm: this rank's heads): their gradients are summed over tp
    shared_tail
               {pattern: config attribute}: linears kept whole whose output's last
               (attribute's value) features go straight to each tp rank's heads (the rope
               part of MLA's ``kv_a_proj_with_mqa``, which bypasses the column-parallel
               ``kv_b_proj``): the gradient of those features is summed over tp
    per_rank   {pattern: attribute names}: int attributes of those modules that count
               features, which tensor parallelism divides by tp (GPT-2's ``split_size``)
    heads      the config attributes counting attention heads: tp must divide each, so a
               rank keeps whole heads (and whole key/value heads under grouped queries)
    vocab      (embedding, LM head): tensor parallelism splits both over the vocab, and the
               loss works on the logits' slices (model.LanguageModel); an LM head that shares
               its embedding's weight shares its rows; ("", LM head): the head alone (the
               embedding stays whole); left out, both stay replicated
    attention  the attention modules, whose core (``attend``) context parallelism replaces
               with Ulysses or ring attention (context_parallel.py)
    experts    the mixture-of-experts layers (the project's ``MoE``: router and experts) or
               their experts modules (transformers' stacked experts), which expert
               parallelism splits (expert_parallel.py)
    pipeline   (embeddings, the blocks' list, final modules): where a pipeline cuts the
               model (pipeline.py): the first piece holds the embeddings, each piece a
               run of blocks, the last the final norm and the LM head
    sequence   (first block, final norm, tp regions): Megatron sequence parallelism shards
               the residual stream along time from the first block's input to the final
               norm's output; the tp regions (attention, MLP: their column-parallel linears'
               modules) all-gather their input and their row-parallel linears reduce-scatter

Everything a plan does not name stays replicated: embeddings, norms, the LM head and, under
tensor parallelism, a mixture-of-experts layer's experts (each tp rank computes them whole).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fnmatch import fnmatch

from torch import nn


@dataclass(frozen=True)
class Plan:
    column: dict = field(default_factory=dict)
    row: tuple = ()
    column_gather: tuple = ()
    row_split: tuple = ()
    column_params: tuple = ()
    heads_split: bool = True
    tp_summed: tuple = ()
    shared_tail: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)
    heads: tuple = ()
    vocab: tuple = ()
    attention: str = ""
    experts: str = ""
    pipeline: tuple = ()
    sequence: tuple = ()


def matching(model: nn.Module, pattern: str, names: bool = False) -> list:
    """The modules of ``model`` (with ``names``: their names) that ``pattern`` matches; at
    least one, or a plan that names a module the model lacks would do nothing silently."""
    found = [(name, m) for name, m in model.named_modules() if fnmatch(name, pattern)]
    if not found:
        raise ValueError(f"the plan's pattern {pattern!r} matches no module of "
                         f"{type(model).__name__}; fix the plan (names as in "
                         "model.named_modules())")
    return [name if names else m for name, m in found]


def matching_parameters(model: nn.Module, pattern: str) -> list:
    """(owner module, attribute name) of each parameter of ``model`` that ``pattern``
    matches by its full name; at least one (as ``matching``)."""
    found = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
             for name, _ in model.named_parameters() if fnmatch(name, pattern)]
    if not found:
        raise ValueError(f"the plan's pattern {pattern!r} matches no parameter of "
                         f"{type(model).__name__}; fix the plan (names as in "
                         "model.named_parameters())")
    return found


def matches(name: str, patterns) -> bool:
    return any(fnmatch(name, p) for p in patterns)


_GPT = Plan(column={"*.attn.q": 1, "*.attn.k": 1, "*.attn.v": 1, "*.mlp.fc1": 1},
            row=("*.attn.proj", "*.mlp.fc2"), per_rank={"*.attn": ("n_heads",)},
            heads=("n_heads",), vocab=("tok_emb", "head"), attention="*.attn",
            sequence=("blocks.0", "ln_f", ("*.attn", "*.mlp")),
            pipeline=(("tok_emb", "pos_emb"), "blocks", ("ln_f", "head")))

_LLAMA = Plan(column={"*.self_attn.q_proj": 1, "*.self_attn.k_proj": 1,
                      "*.self_attn.v_proj": 1, "*.mlp.gate_proj": 1, "*.mlp.up_proj": 1},
              row=("*.self_attn.o_proj", "*.mlp.down_proj"),
              heads=("num_attention_heads", "num_key_value_heads"), attention="*.self_attn",
              sequence=("*.model.layers.0", "*.model.norm", ("*.self_attn", "*.mlp")),
              pipeline=(("*.model.embed_tokens",), "*.model.layers",
                        ("*.model.norm", "*.lm_head")))

PLANS = {
    # the project's GPT; with mixture-of-experts layers in its MLP slots, the layers are
    # made expert-parallel (split over tp and taking cp's or Megatron SP's shards) whole
    "gpt": _GPT,
    "gpt-moe": replace(_GPT, column={k: v for k, v in _GPT.column.items() if "mlp" not in k},
                       row=("*.attn.proj",), sequence=("blocks.0", "ln_f", ("*.attn",)),
                       experts="*.mlp"),
    "gpt2": Plan(column={"*.attn.c_attn": 3, "*.mlp.c_fc": 1},
                 row=("*.attn.c_proj", "*.mlp.c_proj"),
                 per_rank={"*.attn": ("split_size",)}, heads=("n_head",), attention="*.attn",
                 sequence=("*.transformer.h.0", "*.transformer.ln_f", ("*.attn", "*.mlp")),
                 pipeline=(("*.transformer.wte", "*.transformer.wpe"), "*.transformer.h",
                           ("*.transformer.ln_f", "*.lm_head"))),
    "llama": _LLAMA,
    # Mixtral: Llama's attention; its MLP slots are mixture-of-experts layers whose experts
    # stay whole under tp (each tp rank computes them)
    "mixtral": replace(_LLAMA, column={k: v for k, v in _LLAMA.column.items() if "mlp" not in k},
                       row=("*.self_attn.o_proj",),
                       sequence=("*.model.layers.0", "*.model.norm", ("*.self_attn",)),
                       experts="*.mlp.experts"),
}
