"""Model families nobody here wrote: transformers' GPT-2, Llama, Mixtral, Qwen3 and Phi-3
(the suite's), and any other causal LM transformers knows by its ``model_type`` (its own
defaults shrunk to the sizes asked for) or by a user's config.json, built with random
weights (nothing downloaded), as causal language models over the embedded dataset's
vocabulary. ``transformers`` is an optional extra (``pip install commlib[models]``).

Every family is called the same way as the project's GPT: ``model(ids)`` -> logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from commlib_strategies.attention import Scoring
from commlib_strategies.model import LanguageModel
from commlib_strategies.sequence_parallel import positions

FAMILIES = ("gpt2", "llama", "mixtral", "qwen3", "phi3")


def _config(family: str, vocab: int, seq_len: int, d_model: int, layers: int, heads: int,
            experts: int, topk: int):
    import transformers as tf
    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=heads,
                  hidden_size=d_model, max_position_embeddings=seq_len,
                  attn_implementation="eager")
    if family == "gpt2":  # GPT-2's own names; no dropout, so every layout computes the same
        return tf.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=d_model,
                             n_layer=layers, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                             attn_implementation="eager")
    if family == "llama":  # grouped-query attention (2 heads share a key/value head)
        return tf.LlamaConfig(**common, intermediate_size=2 * d_model,
                              num_key_value_heads=heads // 2)
    if family == "mixtral":  # top-k of the experts (2 of 4 by default), no capacity limit
        return tf.MixtralConfig(**common, intermediate_size=2 * d_model,
                                num_key_value_heads=heads // 2, num_local_experts=experts,
                                num_experts_per_tok=topk, router_jitter_noise=0.0)
    if family == "qwen3":  # q and k normed over each head (its plan: its config's own)
        return tf.Qwen3Config(**common, intermediate_size=2 * d_model,
                              num_key_value_heads=heads // 2, head_dim=d_model // heads)
    if family == "phi3":  # fused q|k|v and gate|up (its plan gathers them whole under tp)
        return tf.Phi3Config(**common, intermediate_size=2 * d_model,
                             num_key_value_heads=heads // 2, pad_token_id=None,
                             bos_token_id=None, eos_token_id=None)
    return _shrunk(family, vocab, seq_len, d_model, layers, heads, experts, topk)


# a config's size fields, by transformers' common names (attribute_map translates GPT-2's)
def _sizes(vocab, seq_len, d_model, layers, heads, experts, topk) -> dict:
    return dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=d_model // heads, rotary_dim=d_model // heads,
                intermediate_size=2 * d_model, intermediate_size_mlp=2 * d_model,
                # multi-head latent attention (DeepSeek's): low-rank q and kv, a rotary part
                q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                v_head_dim=d_model // heads,
                max_position_embeddings=seq_len, moe_intermediate_size=d_model,
                shared_expert_intermediate_size=d_model, num_local_experts=experts,
                num_experts=experts, num_experts_per_tok=topk, n_routed_experts=experts,
                n_shared_experts=1,
                n_group=1, topk_group=1,  # (DeepSeek-V3's routing by groups of experts)
                # state-space and linear-attention layers (Mamba-2 hybrids, Qwen3-Next)
                mamba_n_heads=8, mamba_d_head=8, mamba_d_ssm=64, mamba_expand=2,
                mamba_d_state=16, mamba_chunk_size=16, chunk_size=16, ssm_state_size=16,
                mamba_dt_rank=4, mamba_n_groups=1, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_heads=heads, linear_head_dim=d_model // heads,  # (Kimi-Linear's)
                # Gemma-3n's and Gemma-4's per-layer inputs (an embedding of their own), and
                # Gemma-3n's later layers reusing earlier ones' keys
                vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=d_model // heads,
                num_kv_shared_layers=0)


def _shrunk(model_type: str, vocab: int, seq_len: int, d_model: int, layers: int, heads: int,
            experts: int, topk: int):
    """transformers' own config of ``model_type`` with its sizes replaced by ours (those it
    has), no dropout or router jitter (every layout computes the same), and no special
    token past the vocabulary."""
    import transformers as tf
    default = tf.AutoConfig.for_model(_causal_lm(model_type))
    text = getattr(default, "text_config", None)
    if text is not None and not _has(default, "hidden_size"):  # (Llama-4's causal LM is
        return _shrunk(text.model_type, vocab, seq_len, d_model, layers, heads,  # its text
                       experts, topk)                                            # model's)
    sizes = _sizes(vocab, seq_len, d_model, layers, heads, experts or 4, topk)
    if not has_experts(model_type):
        sizes = {k: v for k, v in sizes.items() if "expert" not in k}
    derived = {k for k, v in vars(type(default)).items()  # (Falcon's head_dim)
               if isinstance(v, property) and v.fset is None}
    ours = {k: v for k, v in sizes.items() if _has(default, k) and k not in derived}
    if "kv_lora_rank" in ours:  # latent attention: every head its own keys, a rotary part
        ours.update(num_key_value_heads=heads, **({"head_dim": ours["qk_rope_head_dim"]}
                                                  if "head_dim" in ours else {}))
    if has_experts(model_type):
        ours.update(_sparse_layers_kept(default, layers))
    ours.update({k: 0.0 for k, v in default.to_dict().items()
                 if isinstance(v, float) and any(w in k for w in ("dropout", "pdrop", "jitter"))})
    ours.update(_tokens_past(default.to_dict(), vocab))
    ours.update(_per_layer_kept(default.to_dict(), ours, layers))
    if isinstance(default.to_dict().get("sliding_window"), int) and default.sliding_window > 0:
        ours["sliding_window"] = max(2, seq_len // 4)  # sequences longer than the window
    config = tf.AutoConfig.for_model(model_type, **ours, attn_implementation="eager")
    if getattr(config, "num_layers", layers) < layers:  # (LongCat-Flash's num_hidden_layers
        config.num_layers = layers                      # counts 2 sublayers per layer)
    _towers_shrunk(config, sizes)
    if getattr(config, "rope_parameters", None) == {} and getattr(config, "layer_types", None):
        # (Cohere-Compass's default gives no rope for its layer types, which its model reads)
        config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                  for kind in set(config.layer_types)}
    return config


TOWER_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "head_dim")


def _towers_shrunk(config, sizes: dict) -> None:
    """A multimodal causal LM's vision and audio towers (its sub-configs) at our sizes, in
    place: the model builds them (Phi-4-multimodal's, 13 GB at full size) though text
    never reaches them. A tower whose config refuses the sizes stays as it was."""
    for name in getattr(config, "sub_configs", {}):
        tower = getattr(config, name, None)
        if not hasattr(tower, "to_dict"):
            continue
        fields = tower.to_dict()
        ours = {k: sizes[k] for k in TOWER_SIZES if k in fields}
        try:
            setattr(config, name, type(tower)(**{**fields, **ours}))
        except (TypeError, ValueError):
            pass


def _sparse_layers_kept(default, layers: int) -> dict:
    """Where a config's first layers are dense (DeepSeek-V3's first_k_dense_replace=3, a
    list of per-layer MLP types, the layers without experts), its dense ones among
    ``layers`` as at full size but the last, which keeps its experts: a shrunk model
    without any would have nothing for expert parallelism to split."""
    out = {}
    if isinstance(getattr(default, "first_k_dense_replace", None), int):
        out["first_k_dense_replace"] = min(default.first_k_dense_replace, layers - 1)
    types = getattr(default, "mlp_layer_types", None)
    if isinstance(types, list) and types:
        out["mlp_layer_types"] = types[:layers - 1] + [types[-1]]
    only = getattr(default, "mlp_only_layers", None)
    if isinstance(only, list):
        out["mlp_only_layers"] = [i for i in only if i < layers - 1]
    return out


def _tokens_past(fields: dict, vocab: int) -> dict:
    """The special tokens a config names past the vocabulary: the padding one as None (an
    embedding's padding index must lie in the vocabulary), the others as its last token
    (some configs take only an int: CWM's)."""
    return {k: None if k == "pad_token_id" else vocab - 1
            for k in ("pad_token_id", "bos_token_id", "eos_token_id")
            if isinstance(fields.get(k), int) and fields[k] >= vocab}


def _has(config, key: str) -> bool:
    """Whether ``config`` has ``key`` (as an attribute: GPT-2's attribute_map translates),
    or holds it per layer (Gemma-4's head_dim, whose reading raises)."""
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return key in config.to_dict()


def _per_layer_kept(fields: dict, ours: dict, layers: int) -> dict:
    """A heterogeneous config's per-layer entries (Gemma-4, dots3) for the layers kept,
    without the sizes set for all (each layer takes ours)."""
    per_layer = fields.get("per_layer_config")
    if not isinstance(per_layer, dict) or not per_layer:
        return {}
    kept = {i: {k: v for k, v in entry.items() if k not in ours}
            for i, entry in per_layer.items() if int(i) < layers}
    return {"per_layer_config": {i: entry for i, entry in kept.items() if entry}}


def _causal_lm(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers as tf
        raise ValueError(f"--model {model_type!r}: transformers {tf.__version__} has no causal "
                         f"language model of that model_type; one of: "
                         f"{', '.join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))}")
    return model_type


def has_experts(model_type: str) -> bool:
    """Whether transformers' ``model_type`` has mixture-of-experts layers by default."""
    if model_type in ("gpt2", "llama", "qwen3", "phi3"):
        return False
    if model_type == "mixtral":
        return True
    import transformers as tf
    # (Llama-4's experts are its text model's)
    default = tf.AutoConfig.for_model(_causal_lm(model_type)).get_text_config()
    # (an expert count the default leaves unset counts: DeepSeek-V2's top-k, dots1's)
    counts = ("num_experts_per_tok", "n_routed_experts", "num_local_experts")
    return any(_has(default, k) and getattr(default, k) != 0 for k in counts)


@dataclass(frozen=True)
class FamilyConfig:
    """What builds a family's model (with the seed): a checkpoint records it."""
    family: str  # its model_type, or the path of its config.json
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    experts: int = 0  # Mixtral's mixture-of-experts layers: experts, and each token's top-k
    topk: int = 0


class CausalLM(LanguageModel):
    """A transformers causal LM as a model.LanguageModel (``model(ids) -> logits``, ``loss``,
    as the project's GPT); ``hf`` is the model itself (its state_dict's names are the
    family's own, under ``hf.``)."""

    def __init__(self, hf: nn.Module, config: FamilyConfig):
        super().__init__()
        self.hf, self.config = hf, config

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def architecture(self):
        return self.hf.config

    def run(self, **inputs) -> torch.Tensor:
        """The model on ``input_ids`` (B, T) or ``inputs_embeds`` (B, T, d): a pipeline
        piece past the first passes hidden states on."""
        (x,) = inputs.values()
        where = {} if self.cp_group is None else \
            {"position_ids": positions(x.shape[1], self.cp_group, x.device)}
        return self.hf(**inputs, use_cache=False, **where).logits

    def shard_sequences(self, group) -> None:
        """Context parallelism: the model's attention entry point calls each attention
        module's ``attend`` (context_parallel.py sets it) on this rank's shard. Refused
        for what would then compute something else than one process
        (_not_context_parallel)."""
        refusal = _not_context_parallel(self.hf)
        if refusal:
            raise ValueError(f"context parallel: {self.config.family}: {refusal}")
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        AttentionInterface.register(_ATTENTION, _attend)
        AttentionMaskInterface.register(_ATTENTION, lambda *args, **kwargs: None)  # no masks
        self.hf.config._attn_implementation = _ATTENTION
        super().shard_sequences(group)


_ATTENTION = "commlib_context_parallel"


def _not_context_parallel(hf: nn.Module) -> str:
    """Why a transformers model's layers cannot run on shards of its sequences ("": they
    can): every rank would see its own shard only, or ring attention would attend what the
    model does not."""
    config = hf.config
    scans = ("Lightning", "LinearAttention", "DeltaNet", "DeltaAttention", "Mamba")
    text = _text_modules(hf)
    mixers = sorted({type(parent).__name__ for parent in text
                     if any(isinstance(m, nn.Conv1d) for m in parent.children())
                     or any(w in type(parent).__name__ for w in scans)})
    if mixers:
        return (f"its {', '.join(mixers)} mix the sequence outside attention (a causal "
                "convolution, a state-space or linear-attention scan), which would see "
                "only each rank's shard; train it without --cp")
    selectors = sorted({type(m).__name__ for m in text
                        if any(w in type(m).__name__ for w in ("Compressor", "Indexer"))})
    if selectors:
        return (f"its {', '.join(selectors)} compress or select the keys attention sees "
                "(sparse or compressed attention), which ring and Ulysses attention do not "
                "do; train it without --cp")
    longest = config.max_position_embeddings
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and chunk < longest:
        return (f"its attention sees only its own chunk of {chunk} tokens "
                f"(attention_chunk_size), and its sequences are up to {longest}: ring and "
                "Ulysses attention attend the whole causal past")
    return ""


def _text_modules(hf: nn.Module) -> list:
    """The modules of a causal LM that text reaches: not its vision or audio towers (the
    modules built from its config's other sub-configs, Phi-4-multimodal's), which a batch
    of tokens never runs."""
    towers = {id(getattr(hf.config, name)) for name in getattr(hf.config, "sub_configs", {})
              if getattr(hf.config, name) is not hf.config.get_text_config()}
    skipped, kept = [], []
    for name, m in hf.named_modules():
        if any(name.startswith(t + ".") for t in skipped):
            continue
        if id(getattr(m, "config", None)) in towers:
            skipped.append(name)
        else:
            kept.append(m)
    return kept


def _slides(module) -> bool:
    """Whether the config of an attention module says it looks back a window shorter than
    its sequences (its layer type, or every layer where the config has no types)."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None) or float("inf")
    if not isinstance(window, int) or not 0 < window < longest:
        return False
    types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if types and isinstance(layer, int):
        return types[layer] == "sliding_attention"
    return bool(getattr(config, "use_sliding_window", True))


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q, k, v (batch, heads, time/cp, head_dim) of this
    rank's shard -> (batch, time/cp, heads, head_dim), causal over the whole sequence (the
    model's own mask, built for the shard alone, is not used)."""
    if dropout:
        raise ValueError("context parallel attention has no dropout; build the model with "
                         "attention dropout 0")
    if not hasattr(module, "attend"):
        raise ValueError(f"context parallel: {type(module).__name__} attends through "
                         "transformers' attention interface, but the plan's attention modules "
                         "do not include it; name them in Plan.attention")
    unmet = [feature for feature, asked in (
        ("position_bias", kwargs.get("position_bias") is not None),
        ("is_causal=False", kwargs.get("is_causal") is False),
        ("sinks", kwargs.get("sinks") is not None)) if asked]
    if unmet:
        raise ValueError(f"context parallel: {type(module).__name__} asks its attention for "
                         f"{', '.join(unmet)}, which ring and Ulysses attention do not do")
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(f"context parallel: {type(module).__name__} holds attention sinks "
                         "but does not pass them to the attention (as s_aux); ring and "
                         "Ulysses attention would leave them out")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if not window and _slides(module):
        raise ValueError(f"context parallel: {type(module).__name__} looks back "
                         f"{module.config.sliding_window} tokens only (sliding_window), which "
                         "only its masks say: context parallel attention builds no masks")
    scoring = Scoring(scale=scaling, softcap=kwargs.get("softcap") or None,
                      window=window or None)
    groups = query.shape[1] // key.shape[1]  # grouped queries: each k/v head serves several
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    y = module.attend(query, key, value, scoring=scoring, sinks=sinks)
    return y.transpose(1, 2).contiguous(), None


def build(family: str, vocab: int, seed: int, seq_len: int = 16, d_model: int = 32,
          layers: int = 2, heads: int = 4, experts: int = 4, topk: int = 2) -> CausalLM:
    """A ``family`` model whose random weights depend only on ``seed`` (the global RNG is
    left as it was); ``experts`` and ``topk``: Mixtral's."""
    try:
        import transformers as tf
    except ImportError as e:
        raise ImportError(f"model family {family!r} needs transformers: "
                          "pip install 'commlib[models]'") from e
    config = _config(family, vocab, seq_len, d_model, layers, heads, experts, topk)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            hf = tf.AutoModelForCausalLM.from_config(config)
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            # (transformers' own default leaves out what its model needs: LFM2-MoE's
            # layer_types is None)
            raise ValueError(
                f"--model {family}: transformers {tf.__version__} builds no model from its own "
                f"default config of {family!r} at these sizes ({type(e).__name__}: {e}); pass "
                "--config with the model's config.json") from e
    moe = (experts, topk) if has_experts(family) else (0, 0)
    return CausalLM(hf.float().train(), FamilyConfig(family, vocab, seq_len, d_model, layers,
                                                     heads, *moe))


def _from_file(path: str, vocab: int | None = None):
    """transformers' config that a user's config.json describes (with our ``vocab``: the
    model must read the dataset's tokens)."""
    import json
    try:
        import transformers as tf
    except ImportError as e:
        raise ImportError("--config needs transformers: pip install 'commlib[models]'") from e
    with open(path) as f:
        fields = json.load(f)
    if "model_type" not in fields:
        raise ValueError(f"--config {path}: no model_type in it (transformers' config.json "
                         "names its model's type)")
    if vocab is not None:
        fields.update(vocab_size=vocab, **_tokens_past(fields, vocab))
    return tf.AutoConfig.for_model(_causal_lm(fields.pop("model_type")), **fields,
                                   attn_implementation="eager")


def _described(config, family: str) -> FamilyConfig:
    """What a transformers config says of its model's sizes (experts 0 where it has none)."""
    experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts",
                                                 "n_routed_experts") if hasattr(config, k)), 0)
    return FamilyConfig(family, config.vocab_size, getattr(config, "max_position_embeddings", 0),
                        config.hidden_size, config.num_hidden_layers,
                        config.num_attention_heads, experts or 0,
                        (getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0)


def sizes_of(path: str) -> tuple:
    """(model_type, layers, width, heads, experts, top-k) of a user's config.json (experts
    0 where it has none)."""
    config = _from_file(path)
    c = _described(config, path)
    return config.model_type, c.n_layers, c.d_model, c.n_heads, c.experts, c.topk


def from_file(path: str, vocab: int, seed: int) -> CausalLM:
    """The causal LM a user's config.json describes, its sizes as they are, random weights
    from ``seed``."""
    import transformers as tf
    config = _from_file(path, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = tf.AutoModelForCausalLM.from_config(config)
    return CausalLM(hf.float().train(), _described(config, path))


def causal_lm(hf: nn.Module) -> CausalLM:
    """A transformers causal LM as transformers built it (its modules, dtype and mode as
    they are) as a CausalLM: what the strategies drive. Refuses any other module."""
    config = getattr(hf, "config", None)
    if (getattr(hf, "get_output_embeddings", None) is None or config is None
            or hf.get_output_embeddings() is None):
        raise TypeError(f"{type(hf).__name__} is neither a commlib_strategies LanguageModel "
                        "nor a transformers causal language model (a PreTrainedModel with an "
                        "LM head, as AutoModelForCausalLM builds)")
    return CausalLM(hf, _described(config, config.model_type))



