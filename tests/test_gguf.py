"""GGUF loading: tiny random models written with gguf's own writer the way llama.cpp's converter
writes them (its metadata keys, its tensor names, its q/k row permutation for "llama") must load
to the model the safetensors directory gives, and quantized files to their exact dequantization."""
from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from quickdraft.model.llama import build_transformer
from quickdraft.weights import hf_dir
from quickdraft.weights.gguf_file import read_gguf
from quickdraft.weights.names import TENSOR_NAMES
from tiny_models import BASE, hf_model, save_hf_dir

VOCAB = BASE["vocab_size"]
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2"}
F32_CASES = ["llama-gqa-untied", "llama-mha-tied", "qwen2-qkv-bias", "llama3-rope-scaling"]
QUANT_CASES = ["llama-gqa-untied", "llama-mha-tied", "qwen2-qkv-bias"]
QTYPES = [GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
          GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face tensor, through quickdraft's table (names.py)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    template = f"model.layers.{{i}}.{m.group(2)}" if m else hf
    return dict(TENSOR_NAMES)[template].replace("{i}", m.group(1) if m else "")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for interleaved RoPE."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_parameters(cfg) -> dict:
    """transformers 5 keeps rope_theta and the scaling under `rope_parameters`."""
    d = cfg.to_dict()
    return {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` tensor for rope_type llama3 (divisors of inv_freq)."""
    rs = rope_parameters(cfg)
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rs["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rs["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(hf, path: Path, qtype: GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """Write `hf` as llama.cpp would; 2-D weights quantized to `qtype` when given, 1-D kept F32.
    Returns what was stored per GGUF name (quantized bytes where quantized)."""
    cfg = hf.config
    arch = GGUF_ARCH[cfg.model_type]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_parameters(cfg)["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else {
        GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
        GGMLQuantizationType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
        GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
        GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
        GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])

    stored: dict[str, np.ndarray] = {}
    sd = hf.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied checkpoints have no output.weight
    for name, tensor in sd.items():
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if qtype is not None and w.ndim == 2:
            data = quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        else:
            data = np.ascontiguousarray(w, dtype=np.float32)
            writer.add_tensor(gguf_name(name), data)
        stored[gguf_name(name)] = data
    if rope_parameters(cfg).get("rope_type") == "llama3":
        stored["rope_freqs.weight"] = llama3_rope_factors(cfg)
        writer.add_tensor("rope_freqs.weight", stored["rope_freqs.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    b, t = tokens.shape
    return model(tokens, torch.arange(t).expand(b, t), model.new_cache(b, 64)).logits


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", F32_CASES)
def test_f32_gguf_equals_safetensors_and_transformers(name, tmp_path, tokens):
    hf = hf_model(name)
    write_gguf(hf, tmp_path / "model.gguf")
    ckpt = read_gguf(tmp_path / "model.gguf")
    hf_path = save_hf_dir(hf, tmp_path / "hf")
    hf_config, hf_tensors = hf_dir.read_config(hf_path), hf_dir.read_tensors(hf_path)

    # the config read from metadata is the one config.json gives, where GGUF can say it
    c, ref_c = ckpt.config, hf_config
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                  "rope_theta", "qkv_bias", "tie_word_embeddings"):
        assert getattr(c, field) == getattr(ref_c, field), field
    assert c.rms_norm_eps == pytest.approx(ref_c.rms_norm_eps, rel=1e-6)  # stored as float32

    # every tensor, un-permuted, is bit for bit the safetensors one
    assert set(ckpt.tensors) == set(hf_tensors)
    for key, value in hf_tensors.items():
        assert torch.equal(ckpt.tensors[key], value.float()), key

    ours = build_transformer(ckpt.config, ckpt.tensors, rope_freq_factors=ckpt.rope_freq_factors)
    from_dir = build_transformer(hf_config, hf_tensors)
    logits = logits_of(ours, tokens)
    torch.testing.assert_close(logits, logits_of(from_dir, tokens), atol=1e-5, rtol=0)
    with torch.no_grad():
        ref = hf(tokens).logits
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_gguf_loads_its_exact_dequantization(name, qtype, tmp_path, tokens):
    hf = hf_model(name)
    stored = write_gguf(hf, tmp_path / "model.gguf", qtype)
    ckpt = read_gguf(tmp_path / "model.gguf")
    cfg = hf.config
    permuted = cfg.model_type == "llama"

    expected: dict[str, torch.Tensor] = {}
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.float().numpy()
        if w.ndim == 2:
            # quantization blocks run along rows, so it commutes with llama.cpp's row permutation:
            # the HF-layout weights quantized directly are what the file must load to.
            exact = dequantize(quantize(w, qtype), qtype)
            assert not np.array_equal(exact, w), f"{key}: quantization changed nothing"
        else:
            exact = w
        expected[key] = torch.from_numpy(np.ascontiguousarray(exact))

    assert set(ckpt.tensors) == set(expected)
    for key, value in expected.items():
        assert torch.equal(ckpt.tensors[key], value), key
        # and, in the file's own layout, it is gguf's dequantization of the stored bytes
        raw = stored[gguf_name(key)]
        if raw.dtype == np.uint8:
            loaded = ckpt.tensors[key].numpy()
            if permuted and key.endswith("q_proj.weight"):
                loaded = llama_cpp_permute(loaded, cfg.num_attention_heads)
            elif permuted and key.endswith("k_proj.weight"):
                loaded = llama_cpp_permute(loaded, cfg.num_key_value_heads)
            assert np.array_equal(loaded, dequantize(raw, qtype)), key

    ours = build_transformer(ckpt.config, ckpt.tensors)
    # the metadata's config (checked against config.json in the F32 test; its eps is float32)
    reference = build_transformer(ckpt.config, expected)
    assert torch.equal(logits_of(ours, tokens), logits_of(reference, tokens))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda q: q.name)
def test_k_quant_tensors_dequantize_to_ggufs_values(qtype, tmp_path):
    """gguf cannot quantize to K-quants, so the file holds random blocks with finite scales."""
    from gguf.constants import GGML_QUANT_SIZES
    from quickdraft.weights.gguf_file import dequantize_tensor, open_reader

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * block
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:   # d and dmin lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:                                    # Q6_K: d closes the block
        raw[..., -2:] = scale
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = open_reader(tmp_path / "k.gguf").tensors[0]
    values = dequantize_tensor(tensor)
    assert values.shape == (rows, cols) and values.dtype == np.float32
    assert np.isfinite(values).all() and np.abs(values).max() > 0
    assert np.array_equal(values, dequantize(raw.reshape(rows, -1), qtype))
