"""A model that loads is the checkpoint's model (issue 31): every config field and GGUF key that
changes the math is implemented or refused by name, and every tensor of the file is used, listed as
harmless, or refused by name.

Oracles: transformers' greedy tokens and logits on the same tiny random weights (Llama with
attention and MLP biases, plain and speculative, safetensors and GGUF); UnsupportedArchitecture
messages naming the field, key or tensor for checkpoints that loaded silently before.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quickdraft
from gguf_writer import write_gguf
from quickdraft import SamplingParams, UnsupportedArchitecture
from quickdraft.cli import main
from quickdraft.errors import ModelLoadError
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.proposers import SpecConfig
from quickdraft.weights.gguf_file import config_from_metadata, open_reader, read_gguf, read_metadata
from tiny_models import BASE, hf_model, transformers_greedy
from tiny_tokenizer import tiny_llm_dir, tiny_model, write_llama_gguf

PROMPT = "the cat sat on the mat; the cat sat on the"
BIASED = ["llama-attention-bias", "llama-mlp-bias", "llama-both-biases"]


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, tokens.shape[1])).logits


def edit_config(path: Path, **changes) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return path


def add_tensors(path: Path, **extra: torch.Tensor) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **extra}, str(path / "model.safetensors"))
    return path


# -- biases: implemented, and equal to transformers ------------------------------------------------

@pytest.fixture(scope="module", params=BIASED)
def biased(request, tmp_path_factory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, tiny_llm_dir(root / "hf", request.param),
            write_llama_gguf(tiny_model(request.param), root / "model.gguf"))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_biased_llama_generates_transformers_greedy_tokens_plain_and_speculative(biased, fmt):
    name, directory, gguf = biased
    path = directory if fmt == "safetensors" else gguf
    llm = quickdraft.load(path)
    config = llm.model.config
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (
        "attention" in name or "both" in name, "attention" in name or "both" in name, "mlp" in name or "both" in name)
    expected = transformers_greedy(tiny_model(name), llm.tokenizer.encode(PROMPT), 16)
    assert len(set(expected)) > 3  # a model repeating one token would prove little
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert llm.generate(PROMPT, params=params).token_ids == expected
    # the target as its own draft: every draft accepted, several tokens verified per pass
    spec = SpecConfig("draft", k=4, draft_model=str(path), adaptive=False)
    out = llm.generate(PROMPT, params=params, spec=spec)
    assert out.token_ids == expected
    assert out.stats.accepted_tokens >= 8


# -- config fields that are refused by name ---------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_llm_dir(tmp_path / "model")


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="relu"), "hidden_act 'relu' is not supported; expected one of silu, swish, gelu_pytorch_tanh"),
    (dict(hidden_act="quick_gelu"), "hidden_act 'quick_gelu'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)),
     "partial_rotary_factor 0.25"),
    (dict(rope_scaling=None, rope_parameters=dict(rope_type="proportional", factor=2.0, rope_theta=1e4)),
     "rope scaling type 'proportional'"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="default"))), "one dict for every layer"),
    (dict(quantization_config=dict(quant_method="gptq", bits=4)), r"quantization_config \('gptq'\)"),
    (dict(quantization_config=dict(quant_method="mxfp4")), r"quantization_config \('mxfp4'\) is not supported for llama.*MXFP4 checkpoints load as stored"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
])
def test_config_fields_that_change_the_math_are_refused_by_name(model_dir, changes, message, capsys):
    edit_config(model_dir, **changes)
    with pytest.raises(UnsupportedArchitecture, match=message):
        quickdraft.load(model_dir)
    # and the CLI says so in one line
    assert main(["generate", "-m", str(model_dir), "--prompt", "hi", "-n", "2"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quickdraft: error: "), lines


def hf_config(**changes) -> dict:
    return {**BASE, "model_type": "llama", **changes}


@pytest.mark.parametrize("changes, flags", [
    (dict(attention_bias=True), (True, True, False)),
    (dict(mlp_bias=True), (False, False, True)),
    # transformers' Mistral reads neither key; its Qwen2 has q, k and v biases always, and no others
    (dict(model_type="mistral", attention_bias=True, mlp_bias=True), (False, False, False)),
    (dict(model_type="qwen2", attention_bias=False), (True, False, False)),
])
def test_each_family_has_the_biases_transformers_builds(changes, flags):
    c = ModelConfig.from_hf(hf_config(**changes))
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == flags


def test_keys_a_config_leaves_out_take_the_family_defaults():
    without_eps = {k: v for k, v in hf_config().items() if k != "rms_norm_eps"}
    assert ModelConfig.from_hf(without_eps).rms_norm_eps == 1e-6  # LlamaConfig's, not 1e-5
    # Mistral's window is 4096 on every layer unless the config says null (v0.2 and later: no
    # window); a window never caps the context
    mistral = hf_config(model_type="mistral", max_position_embeddings=8192)
    assert ModelConfig.from_hf(mistral).layer_windows == (4096, 4096)
    assert ModelConfig.from_hf(mistral).max_position_embeddings == 8192
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).layer_windows == ()
    # Qwen2's window applies only with use_sliding_window, false unless said, and then only from
    # layer max_window_layers on (28 unless said), or where layer_types says
    qwen = hf_config(model_type="qwen2", max_position_embeddings=8192, sliding_window=1024)
    assert ModelConfig.from_hf(qwen).layer_windows == ()
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows == ()
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1}).layer_windows == (None, 1024)
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "layer_types": [
        "sliding_attention", "full_attention"]}).layer_windows == (1024, None)
    # Qwen3's head_dim is 128 unless said (not hidden_size / heads)
    assert ModelConfig.from_hf(hf_config(model_type="qwen3", hidden_size=256)).head_dim == 128
    # swish is silu; pretraining_tp only split the matmuls (older transformers): the same model
    assert ModelConfig.from_hf(hf_config(hidden_act="swish", pretraining_tp=2)) == ModelConfig.from_hf(hf_config())


# -- tensors: every one used, listed as harmless, or refused ----------------------------------------

def test_a_tensor_the_model_does_not_use_is_refused_by_name(model_dir):
    add_tensors(model_dir, **{"model.foo.weight": torch.ones(3)})
    with pytest.raises(UnsupportedArchitecture, match=r"1 tensor\(s\) .* does not use: 'model.foo.weight'"):
        quickdraft.load(model_dir)


def test_biases_the_config_does_not_ask_for_are_refused_with_a_count(tmp_path):
    path = tiny_llm_dir(tmp_path / "model", "llama-mlp-bias")
    edit_config(path, mlp_bias=False)  # 2 layers x gate, up, down biases left over
    message = r"6 tensor\(s\) .*'model.layers.0.mlp.down_proj.bias'.* and 2 more"
    with pytest.raises(UnsupportedArchitecture, match=message):
        quickdraft.load(path)


def test_rotary_buffers_old_checkpoints_carry_are_ignored(model_dir):
    reference = logits_of(quickdraft.load(model_dir).model, torch.arange(3, 20)[None])
    inv_freq = torch.ones(BASE["hidden_size"] // BASE["num_attention_heads"] // 2)
    add_tensors(model_dir, **{"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq * 5,
                              "model.layers.1.self_attn.rotary_emb.inv_freq": inv_freq * 5})
    assert torch.equal(logits_of(quickdraft.load(model_dir).model, torch.arange(3, 20)[None]), reference)


def test_a_tied_config_over_a_different_lm_head_runs_that_head_as_transformers_does(tmp_path):
    path = tiny_llm_dir(tmp_path / "model", "llama-mha-tied")
    hf = tiny_model("llama-mha-tied")
    embed = hf.model.embed_tokens.weight.detach()
    tokens = torch.arange(3, 20)[None]
    add_tensors(path, **{"lm_head.weight": embed.clone()})  # a copy of the embeddings: still tied
    assert quickdraft.load(path).model.config.tie_word_embeddings
    add_tensors(path, **{"lm_head.weight": torch.randn_like(embed)})
    ours = quickdraft.load(path).model
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(tokens).logits
    assert not ours.config.tie_word_embeddings
    torch.testing.assert_close(logits_of(ours, tokens), ref, atol=1e-4, rtol=0)
    # handed to the model directly, a tied config over another head is an error, not a choice
    config = ModelConfig.from_hf(hf.config.to_dict())
    tensors = {**hf.state_dict(), "lm_head.weight": torch.randn_like(embed)}
    with pytest.raises(ModelLoadError, match="differs from 'model.embed_tokens.weight'"):
        build_transformer(config, tensors)


def test_a_gguf_tensor_outside_the_name_table_is_refused_by_its_name(tmp_path):
    extra = {"blk.0.attn_q_norm.weight": np.ones(16, np.float32), "blk.1.attn_q_norm.weight": np.ones(16, np.float32)}
    path = tmp_path / "m.gguf"
    write_gguf(hf_model("llama-gqa-untied"), path, metadata=lambda w: [w.add_tensor(n, v) for n, v in extra.items()])
    ckpt = read_gguf(path)
    with pytest.raises(UnsupportedArchitecture, match=r"2 tensor\(s\) .*'blk.0.attn_q_norm.weight', 'blk.1.attn_q"):
        build_transformer(ckpt.config, ckpt.tensors, rope_freq_factors=ckpt.rope_freq_factors)


# -- GGUF metadata --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_meta(tmp_path_factory) -> tuple[dict, set[str]]:
    path = tmp_path_factory.mktemp("meta") / "m.gguf"
    write_gguf(hf_model("llama-gqa-untied"), path)
    reader = open_reader(path)
    return read_metadata(reader), {t.name for t in reader.tensors}


@pytest.mark.parametrize("key, value, message", [
    ("llama.expert_shared_count", 1, "'llama.expert_shared_count' = 1 \\(a shared expert\\)"),
    ("llama.rope.dimension_count", 8, "'llama.rope.dimension_count' = 8 \\(partial rotary"),
    ("llama.attention.value_length", 32, "'llama.attention.value_length' = 32"),
    ("llama.attention.key_length_swa", 32, "'llama.attention.key_length_swa' = 32 \\(another head size in sliding"),
    ("llama.rope.dimension_count_swa", 8, "'llama.rope.dimension_count_swa' = 8"),
    ("llama.rope.scaling.type", "su", "'llama.rope.scaling.type' = 'su'"),
    ("llama.rope.scaling.alpha", 1000.0, "'llama.rope.scaling.alpha' = 1000.0 .*a RoPE setting"),
    ("llama.rope.dimension_sections", [4, 2, 2, 0], "'llama.rope.dimension_sections'"),
    ("llama.rope.scaling.attn_factor", 1.5, "'llama.rope.scaling.attn_factor' = 1.5 .* with rope scaling 'none'"),
    ("llama.rope.scaling.yarn_attn_factor", 1.2, "'llama.rope.scaling.yarn_attn_factor' = 1.2"),
    ("llama.rope.freq_base_swa", 5e5, "'llama.rope.freq_base_swa' = 500000.0 \\(a RoPE base of sliding"),
    ("llama.attention.temperature_length", 8192, "'llama.attention.temperature_length' = 8192 is not supported \\(not a setting"),
    ("llama.expert_used_count", 2, "'llama.expert_used_count' = 2 \\(experts per token"),
    ("general.type", "adapter", "general.type 'adapter' is not supported; expected a model"),
    ("llama.final_logit_softcapping", 30.0, "'llama.final_logit_softcapping' = 30.0"),
    ("llama.attn_logit_softcapping", 50.0, "'llama.attn_logit_softcapping' = 50.0"),
    ("llama.embedding_scale", 12.0, "'llama.embedding_scale' = 12.0"),
    ("llama.attention.causal", False, "non-causal"),
])
def test_gguf_keys_that_change_the_math_are_refused_by_name(gguf_meta, key, value, message):
    meta, names = gguf_meta
    config_from_metadata(meta, names)  # the file as written loads
    with pytest.raises(UnsupportedArchitecture, match=message):
        config_from_metadata({**meta, key: value}, names)


def test_gguf_norm_epsilon_and_window_are_read_not_assumed(gguf_meta):
    meta, names = gguf_meta
    layer_norm = {k: v for k, v in meta.items() if k != "llama.attention.layer_norm_rms_epsilon"}
    with pytest.raises(ModelLoadError, match="lacks required key 'llama.attention.layer_norm_rms_epsilon'"):
        config_from_metadata(layer_norm, names)
    with pytest.raises(UnsupportedArchitecture, match="LayerNorm"):
        config_from_metadata({**layer_norm, "llama.attention.layer_norm_epsilon": 1e-5}, names)
    windowed = config_from_metadata({**meta, "llama.attention.sliding_window": 64}, names)
    assert windowed.layer_windows == (64, 64) and windowed.max_position_embeddings == BASE["max_position_embeddings"]
    assert config_from_metadata({**meta, "llama.attention.sliding_window": 0}, names).layer_windows == ()
    pattern = {"llama.attention.sliding_window": 64, "llama.attention.sliding_window_pattern": [False, True]}
    assert config_from_metadata({**meta, **pattern}, names).layer_windows == (None, 64)
    # neutral values are the model as it is
    assert config_from_metadata({**meta, "llama.expert_count": 0, "llama.rope.scaling.factor": 1.0,
                                 "llama.rope.dimension_count": 16}, names) == config_from_metadata(meta, names)


def test_gguf_linear_rope_scaling_is_read_as_llama_cpp_reads_it(gguf_meta):
    """A factor (rope.scaling.factor, or the older rope.scale_linear) with the type linear or unsaid
    is linear scaling, as in llama.cpp; with type none it is ambiguous, and refused."""
    meta, names = gguf_meta
    for extra in ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                  {"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0}):
        scaling = config_from_metadata({**meta, **extra}, names).rope_scaling
        assert (scaling.kind, scaling.factor) == ("linear", 4.0), extra
    assert config_from_metadata({**meta, "llama.rope.scaling.type": "none"}, names).rope_scaling is None
    with pytest.raises(UnsupportedArchitecture, match="rope scaling type 'none' with factor 2.0"):
        config_from_metadata({**meta, "llama.rope.scaling.type": "none", "llama.rope.scale_linear": 2.0}, names)


def test_experts_in_an_architecture_whose_row_has_none_are_refused_before_its_tensors_are_read(tmp_path):
    """(A "llama" file with experts is Mixtral's: tests/test_moe.py.)"""
    path = tmp_path / "moe.gguf"
    write_gguf(hf_model("qwen2-qkv-bias"), path,
               metadata=lambda w: (w.add_expert_count(8), w.add_expert_used_count(2)))
    with pytest.raises(UnsupportedArchitecture, match="'qwen2' with experts \\(a mixture of experts\\)"):
        read_gguf(path)


@pytest.mark.parametrize("name", ["gemma3-sandwich", "gemma2-softcap", "llama-gqa-untied"])
def test_gguf_end_tokens_of_the_family_end_generation(name, tmp_path):
    """A Gemma GGUF holds one eos_token_id (<eos>); Gemma's generation_config ends on <end_of_turn>
    too, and so does llama.cpp: the family row names it, found in the vocabulary by its string.
    Other families gain nothing from a token of that name."""
    path, hf = tmp_path / "m.gguf", hf_model(name)
    write_gguf(hf, path)
    reader = open_reader(path)
    meta, names = read_metadata(reader), {t.name for t in reader.tensors}
    tokens = [f"<t{i}>" for i in range(hf.config.vocab_size)]
    tokens[40] = "<end_of_turn>"
    meta = {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 1}
    gemma = name.startswith("gemma")
    assert config_from_metadata(meta, names).eos_token_ids == ((1, 40) if gemma else (1,))
    tokens[40] = "<t40>"  # a vocabulary without it: the file's eos alone
    assert config_from_metadata(meta, names).eos_token_ids == (1,)
