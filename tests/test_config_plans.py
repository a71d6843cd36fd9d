"""A transformers model's own parallel plans, translated (commlib_strategies/config_plans.py):
for the families with hand-written plans the translation reaches the same modules; Qwen3's
per-head norms are summed over tp; Phi-3's fused projections are gathered whole; styles
without a counterpart are refused by name."""
from fnmatch import fnmatch

import pytest

pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from commlib_strategies.config_plans import from_config  # noqa: E402
from commlib_strategies.families import build  # noqa: E402
from commlib_strategies.plans import PLANS, matching  # noqa: E402

torch = pytest.importorskip("torch")

SMALL = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             hidden_size=32, intermediate_size=64, head_dim=8, pad_token_id=None,
             bos_token_id=None, eos_token_id=None)


def hf_model(config_class, **more):
    return tf.AutoModelForCausalLM.from_config(config_class(**SMALL, **more))


def reached(model, plan) -> dict:
    """Every field of ``plan`` as the module names it reaches in ``model``."""
    names = [name for name, _ in model.named_modules()]

    def of(patterns):
        return sorted(n for n in names if any(fnmatch(n, p) for p in patterns))
    first, blocks, last = plan.pipeline
    sequence_first, sequence_norm, regions = plan.sequence
    return {"column": {n: parts for p, parts in plan.column.items() for n in of([p])},
            "row": of(plan.row), "tp_summed": of(plan.tp_summed), "heads": plan.heads,
            "attention": of([plan.attention]), "experts": of([plan.experts] if plan.experts
                                                            else []),
            "pipeline": (of(first), of([blocks]), of(last)),
            "sequence": (of([sequence_first]), of([sequence_norm]), of(regions))}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_the_config_reaches_what_the_hand_written_plan_does(family):
    model = build(family, 64, seed=0)
    assert reached(model, from_config(model)) == reached(model, PLANS[family])


def test_qwen3_norms_over_each_head_are_summed_over_tp():
    plan = from_config(hf_model(tf.Qwen3Config))
    assert plan.tp_summed == ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm")
    assert plan.column["model.layers.*.mlp.up_proj"] == 1 and not plan.experts


def test_qwen3_moe_experts_split_by_ep_and_whole_under_tp():
    model = hf_model(tf.Qwen3MoeConfig, num_experts=4, moe_intermediate_size=16)
    plan = from_config(model)
    assert plan.experts == "model.layers.*.mlp.experts"
    # its config's plan names dense MLPs too (a variant's): this model has none to split
    assert set(plan.column) == {f"model.layers.*.self_attn.{x}_proj" for x in "qkv"}
    assert plan.sequence[2] == ("model.layers.*.self_attn",)


def test_phi3_fused_projections_are_gathered_whole():
    plan = from_config(hf_model(tf.Phi3Config))
    assert plan.column_gather == ("model.layers.*.self_attn.qkv_proj",
                                  "model.layers.*.mlp.gate_up_proj")
    assert plan.row_split == ("model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj")
    assert not plan.heads_split and not plan.column  # every tp rank computes every head


def test_styles_without_a_counterpart_are_refused_by_name():
    model = build("llama", 64, seed=0)
    model.hf._tp_plan = {**model.hf._tp_plan, "model.layers.*.self_attn.q_proj": "colwise_rep"}
    with pytest.raises(ValueError, match=r"'model.layers.\*.self_attn.q_proj' the style "
                                         r"'colwise_rep'.*pass a commlib_strategies"):
        from_config(model)
    with pytest.raises(ValueError, match="no tensor parallel plan"):
        from_config(build("gpt2", 64, seed=0))
    with pytest.raises(TypeError, match="holds no transformers model"):
        from_config(pytest.importorskip("torch").nn.Linear(2, 2))


def test_per_head_parameters_are_split_and_other_bare_ones_refused():
    """Attention sinks (a bare parameter, one entry per head, in a module marked
    local_params) are split as the heads are; a bare parameter of another style, or whose
    entries are not one per head, is refused, never passed over."""
    model = build("granite_swa", 64, seed=0)
    assert from_config(model).column_params == ("hf.model.layers.*.self_attn.sinks",)
    plan = model.hf._tp_plan
    for style, shape in (("rowwise", None), ("colwise", 3)):
        if shape:
            for layer in model.hf.model.layers:
                layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(shape))
        model.hf._tp_plan = {**plan, "model.layers.*.self_attn.sinks": style}
        with pytest.raises(ValueError, match=f"'model.layers.\\*.self_attn.sinks' the style "
                                             f"'{style}'"):
            from_config(model)


def test_styles_kept_whole():
    """Inkling's stacked shared experts, under all_reduce, and Aria's packed_rowwise stacked
    experts are kept whole with their entries; Inkling-2's replicated embedding too."""
    plan = from_config(build("inkling_text", 64, seed=0))
    assert not [p for p in [*plan.column, *plan.row, *plan.column_params]
                if "shared_experts" in p], plan
    for family in ("inkling2_text", "aria_text"):
        plan = from_config(build(family, 64, seed=0))
        assert not [p for p in [*plan.column, *plan.row, *plan.column_params]
                    if ".experts" in p or "embed" in p], plan


def test_a_model_as_transformers_built_it_is_wrapped_and_others_refused():
    from torch import nn

    from commlib_strategies.families import causal_lm
    hf = hf_model(tf.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2)
    model = causal_lm(hf)
    assert model.hf is hf and model.config.experts == 4 and model.config.topk == 2
    assert model.config.family == "qwen3_moe" and model.vocab_size == 64
    with pytest.raises(TypeError, match="neither a commlib_strategies LanguageModel nor a "
                                        "transformers causal language model"):
        causal_lm(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nor a transformers causal"):
        causal_lm(tf.AutoModel.from_config(tf.Qwen2Config(**SMALL)))  # no LM head


def test_a_users_config_is_read_as_it_is(tmp_path):
    from commlib_strategies.families import sizes_of
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen2", "hidden_size": 48, "num_hidden_layers": 3, '
                    '"num_attention_heads": 6, "num_key_value_heads": 2}')
    assert sizes_of(str(path)) == ("qwen2", 3, 48, 6, 0, 0)
    path.write_text('{"hidden_size": 48}')
    with pytest.raises(ValueError, match="no model_type in it"):
        sizes_of(str(path))
    path.write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="has no causal language model of that model_type"):
        sizes_of(str(path))


def test_context_parallelism_refuses_what_shards_would_change():
    """Sequence mixing outside attention, compressed keys, and chunked attention shorter than
    the model's sequences are refused by name; a window the model does not use is not."""
    from commlib_strategies.families import _not_context_parallel, build, causal_lm
    for family, words in [("bamba", "mix the sequence outside attention"),
                          ("qwen3_next", "mix the sequence outside attention"),
                          ("deepseek_v4", "compress or select the keys")]:
        with pytest.raises(ValueError, match=f"context parallel: {family}: .*{words}"):
            build(family, 64, 0).shard_sequences(None)
    chunked = causal_lm(hf_model(tf.Llama4TextConfig, attention_chunk_size=4,
                                 max_position_embeddings=16, intermediate_size_mlp=64))
    with pytest.raises(ValueError, match="its own chunk of 4 tokens"):
        chunked.shard_sequences(None)
    unused = hf_model(tf.Qwen2Config, sliding_window=8, use_sliding_window=False,
                      max_position_embeddings=16)
    assert _not_context_parallel(unused) == ""


def test_context_parallel_attention_scores_as_the_model_does():
    """On one rank, ring attention computes transformers' own eager attention: Mistral's
    sliding window (passed to the attention), Gemma-2's soft-capped logits, its scale and
    alternating windows (its modules' own), GPT-OSS's learned sinks; a window only the
    masks say (PhiMoE's) is refused at the first forward."""
    import commlib
    from commlib_strategies.context_parallel import context_parallel_
    from commlib_strategies.families import causal_lm
    world = commlib.init()
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss_of(config_class, cp: bool, **more):
        torch.manual_seed(0)
        model = causal_lm(hf_model(config_class, max_position_embeddings=16, **more))
        if cp:
            context_parallel_(model, world, "ring", 4, [
                m for m in model.modules() if type(m).__name__.endswith("Attention")])
        return model.loss(ids[:, :-1], ids[:, 1:]).item()
    for config_class, more in [(tf.MistralConfig, dict(sliding_window=4)),
                               (tf.Gemma2Config, dict(sliding_window=4,
                                                      query_pre_attn_scalar=12,
                                                      attn_logit_softcapping=2.0)),
                               (tf.GptOssConfig, dict(sliding_window=4, num_local_experts=4))]:
        want = loss_of(config_class, False, **more)
        assert loss_of(config_class, True, **more) == pytest.approx(want, rel=1e-6), config_class
        if "sliding_window" in more:  # the window matters at these sizes
            assert loss_of(config_class, False, **{**more, "sliding_window": 16}) != \
                pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="looks back 8 tokens only .* only its masks say"):
        loss_of(tf.PhimoeConfig, True, sliding_window=8, num_local_experts=4)


def test_attention_modules_found_where_llama_has_none():
    from commlib_strategies.families import build
    assert from_config(build("gpt_neox", 64, 0)).attention == "hf.gpt_neox.layers.*.attention"
    # LongCat-Flash holds a list of them per layer: the list's items, not their parts
    longcat = build("longcat_flash", 64, 0)
    found = matching(longcat, from_config(longcat).attention)
    assert len(found) == 4 and {type(m).__name__ for m in found} == {"LongcatFlashMLA"}


def test_the_vocab_is_split_where_the_plan_says_and_the_lookup_is_plain():
    # transformers' causal LMs name their embedding embedding_rowwise and their head
    # colwise_gather_output: both split over the vocab
    assert from_config(hf_model(tf.LlamaConfig)).vocab == ("model.embed_tokens", "lm_head")
    assert from_config(hf_model(tf.LlamaConfig, tie_word_embeddings=True)).vocab == \
        ("model.embed_tokens", "lm_head")  # (the head shares the embedding's rows)
    # Gemma 3's embedding scales its lookup in its own forward: it stays whole, and so does
    # a head that shares its weight; an untied head is split alone
    gemma = dict(sliding_window=16, layer_types=["full_attention"] * 2)
    assert from_config(hf_model(tf.Gemma3TextConfig, **gemma)).vocab == ()
    assert from_config(hf_model(tf.Gemma3TextConfig, **gemma, tie_word_embeddings=False)
                       ).vocab == ("", "lm_head")
    # a head without the style stays whole
    model = hf_model(tf.LlamaConfig)
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if k != "lm_head"}
    assert from_config(model).vocab == ()


def test_mla_rope_features_are_summed_over_tp():
    config = dict(SMALL, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=8)
    plan = from_config(tf.AutoModelForCausalLM.from_config(tf.MiniCPM3Config(**config)))
    assert plan.shared_tail == {"model.layers.*.self_attn.kv_a_proj_with_mqa": "qk_rope_head_dim"}


def test_a_derived_size_is_left_to_the_config():
    # Falcon's head_dim is a property of its hidden size and heads, not a field to set
    model = build("falcon", 64, seed=0)
    assert model.hf.config.head_dim == model.hf.config.hidden_size // 4


def test_shrinking_meets_each_configs_ways():
    from commlib_strategies.families import has_experts
    # expert counts the default leaves unset still say experts (DeepSeek-V2's top-k, dots1's)
    assert has_experts("deepseek_v2") and has_experts("dots1") and not has_experts("llama")
    assert build("dots1", 64, seed=0).hf.config.n_routed_experts == 4
    # a special token past the vocabulary where the config takes only an int (CWM's)
    assert build("cwm", 64, seed=0).hf.config.bos_token_id == 63
    # per-layer sizes (Gemma-4's head_dim): the layers kept, with the CLI's sizes; its expert
    # parallel plan restates its tensor parallel plan's dense MLP entries, which pass
    gemma4 = build("gemma4_text", 64, seed=0)
    assert all(layer.self_attn.head_dim == 8 for layer in gemma4.hf.model.layers)
    assert from_config(gemma4).column
    # a pipeline plan that names modules the model lacks (HRM's, Llama's) is none
    assert from_config(build("hrm_text", 64, seed=0)).pipeline == ()


def test_shrunk_models_keep_their_experts():
    # DeepSeek-V3's first 3 layers are dense, DeepSeek-V3.2's per-layer MLP types say so,
    # Flint's mlp_only_layers list them: at 2 layers each keeps experts in its last, which
    # its expert parallel plan (grouped_gemm parameters of the dispatched experts) splits
    for family in ("deepseek_v3", "deepseek_v32", "flint"):
        model = build(family, 64, seed=0)
        experts = [n for n, _ in model.named_modules() if n.endswith("mlp.experts")]
        assert experts == ["hf.model.layers.1.mlp.experts"], (family, experts)
        assert from_config(model).experts == "hf.model.layers.*.mlp.experts"


def test_an_embedding_dropout_is_not_a_final_module():
    # Phi registers its embedding dropout after its blocks, GPT-NeoX before them: both take
    # the embeddings (pp plan inputs "inputs_embeds"), so neither is cut as a final module
    # (a piece but the last passes on what its first final module takes) nor is the norm
    # that ends Megatron SP's sequence shards
    for family, norm in (("phi", "hf.model.final_layernorm"),
                         ("gpt_neox", "hf.gpt_neox.final_layer_norm")):
        plan = from_config(build(family, 64, seed=0))
        assert plan.pipeline[2] == (norm, "hf.lm_head") and plan.sequence[1] == norm


def test_a_decoder_without_a_pipeline_plan_is_cut_by_its_parts():
    # OLMoE's config names no cut; its decoder holds an embedding, its blocks and a norm
    plan = from_config(build("olmoe", 64, seed=0))
    assert plan.pipeline == (("hf.model.embed_tokens",), "hf.model.layers",
                             ("hf.model.norm", "hf.lm_head"))
    assert plan.sequence[:2] == ("hf.model.layers.0", "hf.model.norm")
    # a final norm without parameters is cut as one (NanoChat's); a decoder with other
    # parts that hold parameters is not cut (Qwen4-Exp's hyper-connection mixer)
    assert from_config(build("nanochat", 64, seed=0)).pipeline[2] == \
        ("hf.model.norm", "hf.lm_head")
    assert from_config(build("qwen4_exp_text", 64, seed=0)).pipeline == ()


@pytest.mark.parametrize("family", ["nanochat", "falcon_h1", "llama4_text"])
def test_two_pieces_compute_the_whole_model(family):
    """A pipeline's pieces, one after another in one process, give the model's loss: where
    the final norm also normalizes the embeddings (NanoChat, its norm without parameters),
    where blocks return a 1-tuple (Falcon-H1, a Mamba hybrid), where the model asks its
    embedding for its device (Llama-4)."""
    from commlib_strategies.pipeline import Piece
    model = build(family, 64, 0)
    plan = from_config(model)
    first, last = (Piece(model, plan, i, 2, range(i, i + 1)) for i in (0, 1))
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    assert last(first(x), y).item() == pytest.approx(model.loss(x, y).item(), rel=1e-6)


def test_a_piece_refuses_a_model_that_loops_over_its_blocks():
    from commlib_strategies.pipeline import Piece
    model = build("dory", 64, 0)
    piece = Piece(model, from_config(model), 0, 2, range(0, 1))
    with pytest.raises(ValueError, match="ran twice in one forward: the model loops"):
        piece(torch.zeros(2, 16, dtype=torch.long))


def test_multimodal_configs_are_shrunk_whole():
    """Llama-4's causal LM is its text model, built from its text config shrunk; the vision
    and audio towers Phi-4-multimodal's causal LM builds are shrunk too (13 GB at full
    size), and context parallelism does not look into them."""
    llama4 = build("llama4", 64, 0)
    assert llama4.hf.config.hidden_size == 32 and llama4.hf.config.num_hidden_layers == 2
    phi4 = build("phi4_multimodal", 64, 0)
    assert sum(p.numel() for p in phi4.parameters()) < 10_000_000
    assert phi4.hf.config.vision_config.num_hidden_layers == 2
    # its audio tower's convolutions are no sequence mixing of its text
    from commlib_strategies.families import _not_context_parallel
    assert _not_context_parallel(phi4.hf) == ""
