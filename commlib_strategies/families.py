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
                head_dim=d_model // heads, intermediate_size=2 * d_model,
                max_position_embeddings=seq_len, moe_intermediate_size=d_model,
                shared_expert_intermediate_size=d_model, num_local_experts=experts,
                num_experts=experts, num_experts_per_tok=topk, n_routed_experts=experts)


def _shrunk(model_type: str, vocab: int, seq_len: int, d_model: int, layers: int, heads: int,
            experts: int, topk: int):
    """transformers' own config of ``model_type`` with its sizes replaced by ours (those it
    has), no dropout, and no special token past the vocabulary."""
    import transformers as tf
    default = tf.AutoConfig.for_model(_causal_lm(model_type))
    sizes = _sizes(vocab, seq_len, d_model, layers, heads, experts or 4, topk)
    if not has_experts(model_type):
        sizes = {k: v for k, v in sizes.items() if "expert" not in k}
    ours = {k: v for k, v in sizes.items() if hasattr(default, k)}
    ours.update({k: 0.0 for k, v in default.to_dict().items()
                 if isinstance(v, float) and ("dropout" in k or "pdrop" in k)})
    ours.update(_tokens_past(default.to_dict(), vocab))
    return tf.AutoConfig.for_model(model_type, **ours, attn_implementation="eager")


def _tokens_past(fields: dict, vocab: int) -> dict:
    """The special tokens a config names past the vocabulary, as None (an embedding's
    padding index must lie in it)."""
    return {k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id")
            if isinstance(fields.get(k), int) and fields[k] >= vocab}


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
    default = tf.AutoConfig.for_model(_causal_lm(model_type))
    return bool(getattr(default, "num_experts_per_tok", 0))


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
        module's ``attend`` (context_parallel.py sets it) on this rank's shard."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        AttentionInterface.register(_ATTENTION, _attend)
        AttentionMaskInterface.register(_ATTENTION, lambda *args, **kwargs: None)  # no masks
        self.hf.config._attn_implementation = _ATTENTION
        super().shard_sequences(group)


_ATTENTION = "commlib_context_parallel"


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q, k, v (batch, heads, time/cp, head_dim) of this
    rank's shard -> (batch, time/cp, heads, head_dim), causal over the whole sequence (the
    model's own mask, built for the shard alone, is not used)."""
    if dropout:
        raise ValueError("context parallel attention has no dropout; build the model with "
                         "attention dropout 0")
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"context parallel attention scales by 1/sqrt(head_dim), the model "
                         f"asks for {scaling}")
    groups = query.shape[1] // key.shape[1]  # grouped queries: each k/v head serves several
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return module.attend(query, key, value).transpose(1, 2).contiguous(), None


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
        hf = tf.AutoModelForCausalLM.from_config(config)
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



