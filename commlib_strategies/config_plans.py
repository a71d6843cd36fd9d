"""A transformers model's own parallel plans, translated into a commlib ``Plan`` (plans.py).

transformers' decoder configs carry where tensor, expert and pipeline parallelism apply to
their models (``base_model_tp_plan``, ``base_model_ep_plan``, ``base_model_pp_plan``),
which a causal LM merges with its head's into {module pattern: style} over its own names
(``_tp_plan``, ``_ep_plan``, ``_pp_plan``: ``model.layers.*.mlp.up_proj``, ``lm_head``).
Each style becomes what the strategies already have:

    colwise                         column-parallel linear
    packed_colwise                  column-parallel, each fused part split on its own
                                    (``gate_up_proj``: gate | up)
    rowwise                         row-parallel linear
    replicated_with_grad_allreduce  kept whole, its gradient summed over tp (a norm over each
                                    head, which sees only this rank's heads: Qwen3's q_norm)
    moe_tp_experts                  the experts stay whole under tp (each tp rank computes
                                    them, as for Mixtral); the styles of their parameters
                                    (packed_rowwise too) are those of the stacked experts,
                                    which expert parallelism splits instead
    moe_identity_expert             nothing to do: an identity expert among experts kept
                                    whole (transformers divides its input by the tp size
                                    because its tp ranks sum their experts' outputs)
    all_reduce                      kept whole with what its own entries split (Inkling's
                                    stacked shared experts): each tp rank computes it whole,
                                    so there is no partial output to sum
    replicate                       kept whole
    embedding_colwise               kept whole (an embedding other than the input's,
                                    whose table every rank then holds)
    ep_dispatch_experts             the experts expert parallelism splits
    colwise_gather_output           column-parallel, its output gathered whole (Phi-3's
                                    fused q|k|v: every tp rank then computes every head)
    rowwise_split_input             row-parallel, splitting the whole input it takes
    mla_kv_a_proj                   kept whole; the rope features of its output (the
                                    config's qk_rope_head_dim), which reach each rank's
                                    heads without the column-parallel kv_b_proj, have their
                                    gradient summed over tp (Plan.shared_tail)
    colwise                         on a bare parameter (no module of its own) with one
                                    entry per attention head, such as attention sinks:
                                    each rank keeps its heads' entries (Plan.column_params)
    local_params                    nothing to do: the module's parameters' parts are what
                                    its forward runs on here
    colwise_gather_output           on the LM head: split over the vocab (Plan.vocab), the
                                    loss computed on the logits' slices, never gathered;
                                    kept whole where the head is not a linear layer, or
                                    shares the weight of an embedding kept whole
    embedding_rowwise               on the input embedding: split over the vocab with the
                                    head (the rows of a tied head are the embedding's);
                                    kept whole where it is not a plain nn.Embedding lookup
                                    (a scaled embedding's own forward)

Any other style, or one of these where it cannot mean what it says, is refused naming the
module and the style: a plan is never half applied. A hand-written ``Plan`` overrides.
"""
from __future__ import annotations

import re
from fnmatch import fnmatch

from torch import nn

from commlib_strategies.plans import Plan
from commlib_strategies.tensor_parallel import plain_lookup

STACKED = ("grouped_gemm", "packed_colwise", "packed_rowwise", "rowwise", "colwise")  # under
# the experts
WHOLE = ("replicate", "embedding_colwise")  # kept whole
KEEP_WITH_THEIR_ENTRIES = ("moe_tp_experts", "all_reduce")  # whole, their STACKED entries too
EMBEDDING_STYLE, HEAD_STYLE = "embedding_rowwise", "colwise_gather_output"  # split over the vocab


def from_config(model: nn.Module) -> Plan:
    """The plan ``model``'s transformers config gives (``model`` is a transformers causal LM,
    or a module holding one, such as families.CausalLM); patterns name ``model``'s own
    modules. Raises ValueError naming what has no counterpart here."""
    hf = _causal_lm(model)
    tp_plan, ep_plan = dict(hf._tp_plan or {}), dict(getattr(hf, "_ep_plan", None) or {})
    if not tp_plan:
        raise ValueError(f"{type(hf).__name__}'s config carries no tensor parallel plan; pass "
                         "a commlib_strategies.plans.Plan naming its modules")
    within = next(name for name, m in model.named_modules() if m is hf)
    names = [name for name, _ in model.named_modules()]
    params = dict(model.named_parameters())

    def at(pattern, among=names):  # the pattern among model's names, or None where none matches
        pattern = f"{within}.{pattern}" if within else pattern
        return pattern if any(fnmatch(name, pattern) for name in among) else None

    dispatched = [p for p, style in ep_plan.items() if style == "ep_dispatch_experts"]
    experts = [p for p in dispatched if at(p)]  # (a variant may have none: all dense)
    if len(experts) > 1:
        raise ValueError(f"{type(hf).__name__}'s expert parallel plan names {len(experts)} "
                         "kinds of experts; commlib's expert parallelism takes one")
    for pattern, style in ep_plan.items():
        if tp_plan.get(pattern) == style:
            continue  # (the tp plan's own entry restated for expert parallel meshes: Gemma-4's
            # dense MLPs beside its experts)
        if style != "ep_dispatch_experts" and not (
                style == "grouped_gemm" and any(pattern.startswith(e + ".") for e in dispatched)):
            _refuse(hf, pattern, style, "expert")
    whole = [p for p, style in tp_plan.items() if style in KEEP_WITH_THEIR_ENTRIES]
    head = next(name for name, m in hf.named_modules() if m is hf.get_output_embeddings())
    embedding = next(name for name, m in hf.named_modules() if m is hf.get_input_embeddings())
    column, row, summed, gather, split, tail, per_head = {}, [], [], [], [], {}, []
    for pattern, style in tp_plan.items():
        if any(pattern.startswith(w + ".") for w in whole) and style in STACKED:
            continue  # the stacked experts' parameters: see moe_tp_experts, all_reduce
        if (pattern, style) in ((embedding, EMBEDDING_STYLE), (head, HEAD_STYLE)):
            continue  # split over the vocab, or kept whole: _vocab
        if style == "local_params":  # (each module here runs on its own parameters' parts)
            continue
        if style in WHOLE + KEEP_WITH_THEIR_ENTRIES or (style == "moe_identity_expert" and
                              any(pattern.startswith(w + ".") for w in whole)):
            continue
        if at(pattern) is None and (bare := at(pattern, params)):  # a bare parameter
            heads = getattr(hf.config, "num_attention_heads", None)
            if style != "colwise" or any(p.shape[0] != heads for name, p in params.items()
                                         if fnmatch(name, bare)):
                _refuse(hf, pattern, style, "tensor")
            per_head.append(bare)  # (attention sinks: one entry per head)
            continue
        if style not in STYLES or (style == "packed_colwise" and
                                   not pattern.endswith("gate_up_proj")):
            _refuse(hf, pattern, style, "tensor")
        # (a family's plan covers its variants: a pattern no module of this model matches,
        # such as dense MLPs in a model whose every layer has experts, has nothing to do)
        if (where := at(pattern)) is None:
            continue
        if style in ("colwise", "packed_colwise"):
            column[where] = 2 if style == "packed_colwise" else 1
        elif style == "rowwise":
            row.append(where)
        elif style == "colwise_gather_output":
            gather.append(where)
        elif style == "rowwise_split_input":
            split.append(where)
        elif style == "mla_kv_a_proj":
            if not getattr(hf.config, "qk_rope_head_dim", None):
                _refuse(hf, pattern, style, "tensor")
            tail[where] = "qk_rope_head_dim"
        else:
            summed.append(where)
    heads = tuple(a for a in ("num_attention_heads", "num_key_value_heads")
                  if getattr(hf.config, a, None))
    regions = tuple(sorted({p.rsplit(".", 1)[0] for p in [*column, *gather]}))  # attn, MLP
    attention = at("model.layers.*.self_attn") or at(_attention_modules(hf)) or ""
    heads_split = not any(p.startswith(attention + ".") for p in gather)
    if attention and all(isinstance(m, nn.ModuleList) for name, m in model.named_modules()
                         if fnmatch(name, attention)):
        attention += ".?"  # (a list of them per layer: LongCat-Flash's; "?": not their parts)

    return Plan(column=column, row=tuple(row), column_gather=tuple(gather),
                vocab=_vocab(hf, tp_plan, embedding, head, at),
                row_split=tuple(split), column_params=tuple(per_head),
                tp_summed=tuple(summed), shared_tail=tail, heads=heads,
                heads_split=heads_split, attention=attention,
                experts=at(experts[0]) if experts else "",
                **_cuts(hf, at, names, regions, at(head)))


STYLES = ("colwise", "packed_colwise", "rowwise", "colwise_gather_output",
          "rowwise_split_input", "replicated_with_grad_allreduce", "moe_tp_experts",
          "mla_kv_a_proj")


def _vocab(hf, tp_plan: dict, embedding: str, head: str, at) -> tuple:
    """Plan.vocab for the head and the embedding the plan splits (see the module's
    docstring): (embedding, head), ("", head) or ()."""
    head_module, embedding_module = hf.get_output_embeddings(), hf.get_input_embeddings()
    if tp_plan.get(head) != HEAD_STYLE or type(head_module) is not nn.Linear:
        return ()
    if tp_plan.get(embedding) == EMBEDDING_STYLE and plain_lookup(embedding_module):
        return at(embedding), at(head)
    tied = head_module.weight is embedding_module.weight
    return () if tied else ("", at(head))


def _cuts(hf, at, names, regions, head) -> dict:
    """Where pipeline and Megatron sequence parallelism cut the model, from ``_pp_plan``:
    the embeddings (what takes input_ids), the blocks (the module list), the final modules
    (the rest, in order: the final norm, the LM head); without one, from the decoder's own
    parts (_plain_decoder); none where neither says."""
    pp_plan = dict(getattr(hf, "_pp_plan", None) or {})
    # (a plan naming modules the model lacks, as HRM's names Llama's, is none)
    modules = dict(hf.named_modules())
    if not all(k in modules for k in pp_plan) or \
            not any(isinstance(modules[k], nn.ModuleList) for k in pp_plan):
        pp_plan = _plain_decoder(hf)  # (the head's own entry alone, or nothing)
    places = {key: at(key) for key in pp_plan}
    blocks = [k for k in pp_plan if isinstance(hf.get_submodule(k), nn.ModuleList)]
    if len(blocks) != 1 or None in places.values():
        return {}
    first = tuple(places[k] for k, (inputs, _) in pp_plan.items() if "input_ids" in inputs)
    # the final modules take hidden states; what takes the embeddings on their way to the
    # blocks (an embedding dropout, registered anywhere: Phi's after its blocks) stays on
    # every piece
    last = sorted((places[k] for k, (inputs, _) in pp_plan.items()
                   if k != blocks[0] and not {"input_ids", "inputs_embeds"} & set(inputs)),
                  key=names.index)
    norm = next((p for p in last if p != head), None)
    # Megatron SP gathers the sequence at the final norm: not where a norm without
    # parameters may also run before the blocks (NanoChat's, on the embeddings)
    gathers = norm and any(True for _ in hf.get_submodule(
        next(k for k in pp_plan if places[k] == norm)).parameters())
    return {"pipeline": (first, places[blocks[0]], tuple(last)),
            "sequence": (f"{places[blocks[0]]}.0", norm, regions) if gathers else ()}


def _plain_decoder(hf) -> dict:
    """A pipeline plan, as ``_pp_plan`` gives one, for a model whose config names no cut
    but whose decoder (the module holding its input embedding) holds only embeddings
    (nn.Embedding), one list of blocks and one final norm (with parameters or without:
    NanoChat's), besides parts without parameters (rotary tables, dropout): {} for anything
    else, which stays uncut."""
    embedding = hf.get_input_embeddings()
    base = next((m for m in hf.modules() if any(c is embedding for c in m.children())), hf)
    if base is hf:
        return {}
    within = next(name for name, m in hf.named_modules() if m is base)
    parts = {name: m for name, m in base.named_children() if any(True for _ in m.parameters())}
    lists = [n for n, m in parts.items() if isinstance(m, nn.ModuleList)]
    embeddings = [n for n, m in parts.items() if isinstance(m, nn.Embedding)]
    rest = [n for n in parts if n not in lists + embeddings] or \
        [n for n, m in base.named_children() if "norm" in type(m).__name__.lower()]
    if len(lists) != 1 or not embeddings or len(rest) != 1 or \
            "norm" not in type(getattr(base, rest[0])).__name__.lower():
        return {}
    head = next(name for name, m in hf.named_modules() if m is hf.get_output_embeddings())
    return {**{f"{within}.{n}": (["input_ids"], ["inputs_embeds"]) for n in embeddings},
            f"{within}.{lists[0]}": (["hidden_states"], ["hidden_states"]),
            f"{within}.{rest[0]}": (["hidden_states"], ["hidden_states"]),
            head: (["hidden_states"], ["logits"])}


def _causal_lm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if hasattr(m, "_tp_plan") and hasattr(m, "get_output_embeddings"):
            return m
    raise TypeError(f"{type(model).__name__} holds no transformers model; pass a "
                    "commlib_strategies.plans.Plan naming its modules")


def _refuse(hf, pattern: str, style: str, kind: str):
    raise ValueError(f"{type(hf).__name__}'s {kind} parallel plan gives {pattern!r} the style "
                     f"{style!r}, which commlib's strategies have no counterpart for; pass a "
                     "commlib_strategies.plans.Plan for this model")


def _attention_modules(hf: nn.Module) -> str:
    """The pattern of a model's attention modules where they are not Llama's
    ``model.layers.*.self_attn`` (GPT-NeoX's ``gpt_neox.layers.*.attention``): the modules
    of a class named ...Attention, the layer index a wildcard, and where stacks of layers
    hold them (HRM's L_module and H_module), the stack too ("" if not one pattern)."""
    def attention(m):
        return type(m).__name__.endswith("Attention")
    patterns = {re.sub(r"\.\d+(\.|$)", r".*\1", name) for name, m in hf.named_modules()
                if attention(m)}
    places = [p.split(".") for p in patterns]
    if len(patterns) > 1 and len({len(p) for p in places}) == 1:
        merged = ".".join(s[0] if len(set(s)) == 1 else "*" for s in zip(*places))
        if all(attention(m) for name, m in hf.named_modules() if fnmatch(name, merged)):
            patterns = {merged}
    return patterns.pop() if len(patterns) == 1 else ""
