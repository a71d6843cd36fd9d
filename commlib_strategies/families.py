"""Model families nobody here wrote: transformers' GPT-2, Llama, Mixtral, Qwen3 and Phi-3,
built from small configs with random weights (nothing downloaded), as causal language
models over the embedded dataset's vocabulary. ``transformers`` is an optional extra (``pip install
commlib[models]``).

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
    raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


@dataclass(frozen=True)
class FamilyConfig:
    """What builds a family's model (with the seed): a checkpoint records it."""
    family: str
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
    moe = (experts, topk) if family == "mixtral" else (0, 0)
    return CausalLM(hf.float().train(), FamilyConfig(family, vocab, seq_len, d_model, layers,
                                                     heads, *moe))
