"""Per-family plans: where each kind of parallelism applies to a model, by module name.

A plan names modules with fnmatch patterns over the model's ``named_modules()`` ("*"
matches dots too), the way torch's ``parallelize_module`` takes a name -> style map, so a
plan for a new family is a short declaration:

    column     {pattern: parts}: linears made column-parallel (``parts``: a fused projection
               such as GPT-2's q|k|v, each part split on its own)
    row        patterns of linears made row-parallel (they take a column-parallel output)
    per_rank   {pattern: attribute names}: int attributes of those modules that count
               features, which tensor parallelism divides by tp (GPT-2's ``split_size``)
    heads      the config attributes counting attention heads: tp must divide each, so a
               rank keeps whole heads (and whole key/value heads under grouped queries)
    experts    the pattern of the mixture-of-experts layers' experts modules, which expert
               parallelism splits (expert_parallel.py)
    pipeline   (embeddings, the blocks' list, final modules): where a pipeline cuts the
               model (pipeline_cut.py): the first piece holds the embeddings, each piece a
               run of blocks, the last the final norm and the LM head
    sequence   (first block, final norm, tp regions): Megatron sequence parallelism shards
               the residual stream along time from the first block's input to the final
               norm's output; the tp regions (attention, MLP: their column-parallel linears'
               modules) all-gather their input and their row-parallel linears reduce-scatter

Everything a plan does not name stays replicated: embeddings, norms, the LM head and, under
tensor parallelism, a mixture-of-experts layer's experts (each tp rank computes them whole).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Plan:
    column: dict = field(default_factory=dict)
    row: tuple = ()
    per_rank: dict = field(default_factory=dict)
    heads: tuple = ()
    experts: str = ""
    pipeline: tuple = ()
    sequence: tuple = ()


_LLAMA_ATTENTION = dict(column={"*.self_attn.q_proj": 1, "*.self_attn.k_proj": 1,
                                "*.self_attn.v_proj": 1},
                        row=("*.self_attn.o_proj",),
                        heads=("num_attention_heads", "num_key_value_heads"),
                        sequence=("*.model.layers.0", "*.model.norm", ("*.self_attn",)),
                        pipeline=(("*.model.embed_tokens",), "*.model.layers",
                                  ("*.model.norm", "*.lm_head")))

PLANS = {
    "gpt2": Plan(column={"*.attn.c_attn": 3, "*.mlp.c_fc": 1},
                 row=("*.attn.c_proj", "*.mlp.c_proj"),
                 per_rank={"*.attn": ("split_size",)}, heads=("n_head",),
                 sequence=("*.transformer.h.0", "*.transformer.ln_f", ("*.attn", "*.mlp")),
                 pipeline=(("*.transformer.wte", "*.transformer.wpe"), "*.transformer.h",
                           ("*.transformer.ln_f", "*.lm_head"))),
    "llama": Plan(column={**_LLAMA_ATTENTION["column"], "*.mlp.gate_proj": 1,
                          "*.mlp.up_proj": 1},
                  row=_LLAMA_ATTENTION["row"] + ("*.mlp.down_proj",),
                  heads=_LLAMA_ATTENTION["heads"], pipeline=_LLAMA_ATTENTION["pipeline"],
                  sequence=("*.model.layers.0", "*.model.norm", ("*.self_attn", "*.mlp"))),
    "mixtral": Plan(**_LLAMA_ATTENTION, experts="*.mlp.experts"),
}
