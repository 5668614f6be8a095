"""Each family's row (model/families.py) against transformers' config classes: the fields a
config resolves to, every field of the class used, refused by name or listed as changing no
logits, the tensor names both ways, and RoPE scaling's frequencies bitwise transformers'.
"""
from __future__ import annotations

import pytest
import torch

from quickdraft import UnsupportedArchitecture
from quickdraft.errors import ModelLoadError
from quickdraft.model.config import ModelConfig
from quickdraft.model.families import FAMILIES
from tiny_models import BASE, hf_model

# -- what each row reads, and what is refused ----------------------------------------------------

@pytest.mark.parametrize("name, fields", [
    ("mistral-window", dict(norm="pre", qk_norm=None, layer_windows=(8, 8), qkv_bias=False)),
    ("qwen3-qk-norm", dict(norm="pre", qk_norm="head", layer_windows=(), qkv_bias=False)),
    ("qwen3-window-layer", dict(norm="pre", qk_norm="head", layer_windows=(None, 6), qkv_bias=True, o_bias=True)),
    ("olmo2-post-norm", dict(norm="post", qk_norm="proj", layer_windows=(), o_bias=False)),
    ("phi3-fused-window", dict(norm="pre", qk_norm=None, layer_windows=(12, 12), qkv_bias=False)),
])
def test_each_family_resolves_to_the_fields_transformers_builds(name, fields):
    config = ModelConfig.from_hf(hf_model(name).config.to_dict())
    assert {k: getattr(config, k) for k in fields} == fields
    assert config.max_position_embeddings == BASE["max_position_embeddings"]  # a window is not the context


# Fields of transformers' config classes that change no logits: dropout (off at inference), training
# and output plumbing (the experts' load-balancing loss and router jitter too), the padding index (only
# where gradients go); Phi-3's original_max_position_embeddings is read by LongRoPE alone (its own test
# below).
NO_MATH = {"attention_dropout", "embd_pdrop", "resid_pdrop", "initializer_range", "use_cache", "pad_token_id",
           "chunk_size_feed_forward", "dtype", "id2label", "label2id", "problem_type", "is_encoder_decoder",
           "output_hidden_states", "return_dict", "transformers_version", "pretraining_tp",
           "original_max_position_embeddings", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}
# Another value for each field that changes the math: the resolved config must differ, or refuse it.
CHANGED = dict(attention_bias=True, mlp_bias=True, head_dim=32, hidden_act="relu", hidden_size=128, intermediate_size=96,
               max_position_embeddings=512, num_attention_heads=2, num_hidden_layers=3, num_key_value_heads=1,
               rms_norm_eps=1e-3, vocab_size=97, tie_word_embeddings=True, bos_token_id=5, eos_token_id=7,
               rope_parameters=dict(rope_type="default", rope_theta=5000.0), sliding_window=5,
               use_sliding_window=False, max_window_layers=0, layer_types=["sliding_attention", "full_attention"],
               architectures=["LlamaForTokenClassification"], hidden_activation="gelu", query_pre_attn_scalar=64,
               final_logit_softcapping=20.0, attn_logit_softcapping=40.0, use_bidirectional_attention=True,
               num_experts=16, num_local_experts=16, num_experts_per_tok=1, moe_intermediate_size=48,
               norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[0], swiglu_alpha=1.5, swiglu_limit=6.0)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_field_of_the_families_config_class_is_used_or_refused(model_type):
    """Each field transformers' config class of the family has (what its model reads) either changes
    the config we resolve, is refused by name, or is listed as changing no logits: a new field in a
    newer transformers fails here until it is accounted for."""
    import dataclasses

    from transformers import AutoConfig
    windowed = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1) if "qwen" in model_type else {}
    base = AutoConfig.for_model(model_type, **{**BASE, "head_dim": 16, **windowed}).to_dict()
    fields = {f.name for f in dataclasses.fields(type(AutoConfig.for_model(model_type)))}
    assert fields - NO_MATH <= set(CHANGED), sorted(fields - NO_MATH - set(CHANGED))
    reference = ModelConfig.from_hf(base)
    for key in sorted(fields - NO_MATH):
        value = CHANGED[key]
        if isinstance(value, list) and value == base.get(key):
            value = value[::-1]
        config = {**base, key: not base[key] if isinstance(value, bool) and key in base else value}
        if key == "max_window_layers":  # read only to make layer_types where a config has none
            del config["layer_types"]
        try:
            changed = ModelConfig.from_hf(config)
        except UnsupportedArchitecture:
            continue
        assert changed != reference, f"{model_type}: {key}={config[key]!r} changes nothing we build"


def hf_config(model_type: str, **changes) -> dict:
    return {**BASE, "model_type": model_type, **changes}


@pytest.mark.parametrize("model_type, changes, message", [
    ("phi3", dict(rope_scaling=dict(type="su", long_factor=[1.0] * 8, short_factor=[1.0] * 8)), "'su'"),
    ("phi3", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ("qwen3", dict(use_sliding_window=True, layer_types=["chunked_attention", "full_attention"]),
     "layer_types .*chunked_attention"),
    ("qwen3", dict(rope_parameters=dict(rope_type="proportional", factor=4.0, rope_theta=1e4)),
     "rope scaling type 'proportional'"),
    ("olmo2", dict(hidden_act="relu"), "hidden_act 'relu'"),
    ("mistral", dict(sliding_window=-3), "sliding_window must be a positive integer"),
    ("gemma", {}, "model_type 'gemma' is not supported; expected one of llama, mistral, qwen2, qwen3"),
    ("gemma2", dict(attn_logit_softcapping=-1.0), "a soft-cap must be a positive number"),
    ("gemma3_text", dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0 \\(soft-capped logits\\)"),
    ("gemma3_text", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)), "one dict per layer type"),
    ("gemma3_text", dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                              sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
     "of sliding layers"),
])
def test_what_a_family_does_not_implement_is_refused_by_name(model_type, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(hf_config(model_type, **changes))


def test_every_family_row_names_each_part_once_and_both_ways():
    """A row's tensor names map one to one (a GGUF name back to one HF name), and the GGUF
    architectures are those llama.cpp's converter writes for them."""
    from quickdraft.weights.names import gguf_name_for_hf, hf_name_for_gguf
    assert {f.gguf_arch for f in FAMILIES.values()} == {None, "llama", "qwen2", "qwen3", "olmo2", "phi3", "gemma2",
                                                        "gemma3", "qwen3moe", "gpt-oss"}
    for family in FAMILIES.values():
        for role, (hf, gguf) in family.names.items():
            hf0, gguf0 = hf.replace("{i}", "3"), gguf.replace("{i}", "3")
            # an expert's matrix: one GGUF tensor of every expert's, its HF name with "{e}" left in
            assert gguf_name_for_hf(hf0.replace("{e}", "5"), family) == gguf0, (role, family)
            assert hf_name_for_gguf(gguf0, family) == hf0, (role, family)


# -- RoPE scaling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, rope_theta=1e6),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=2048, rope_theta=1e4, beta_fast=16,
         beta_slow=2, truncate=False),
    dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, rope_theta=1e4, mscale=1.0,
         mscale_all_dim=0.707),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=1024, rope_theta=5e5, attention_factor=1.25),
    dict(rope_type="linear", factor=3.0, rope_theta=1e4),
    dict(rope_type="dynamic", factor=4.0, rope_theta=1e4),  # within max_position_embeddings: default RoPE
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_frequencies_and_attention_factor_equal_transformers(rope, head_dim):
    """Our inverse frequencies and cos/sin scale for each scaling are transformers' own, bitwise,
    over real head widths and contexts (the tiny models' parity covers a 16-wide head only)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from quickdraft.model.rope import RotaryTable, inverse_frequencies
    hf = AutoConfig.for_model("llama", hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                              max_position_embeddings=32768, rope_parameters=dict(rope))
    ref, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    config = ModelConfig.from_hf(hf.to_dict())
    assert torch.equal(inverse_frequencies(config), ref.float())
    assert RotaryTable.of(config).scale == factor


@pytest.mark.parametrize("head_dim", [64, 96])
def test_longrope_runs_within_the_original_context_with_transformers_frequencies(head_dim):
    """LongRoPE (Phi-3 128k): within the original context transformers rotates with the short
    factors, times its attention factor; past it, every position switches to the long ones, which
    K/V already cached cannot follow, so the model's context is the original one."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from quickdraft.model.rope import RotaryTable, inverse_frequencies
    n = head_dim // 2
    hf = AutoConfig.for_model("phi3", hidden_size=head_dim * 4, num_attention_heads=4, pad_token_id=None,
                              max_position_embeddings=131072, original_max_position_embeddings=4096,
                              rope_scaling=dict(type="longrope", short_factor=[1 + i / n for i in range(n)],
                                                long_factor=[2 + i for i in range(n)]))
    ref, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    config = ModelConfig.from_hf(hf.to_dict())
    assert torch.equal(inverse_frequencies(config), ref.float())
    assert RotaryTable.of(config).scale == factor > 1
    assert config.max_position_embeddings == 4096
