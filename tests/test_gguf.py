"""GGUF loading: tiny random models written with gguf's own writer the way llama.cpp's converter
writes them (its metadata keys, its tensor names, its q/k row permutation for "llama") must load
to the model the safetensors directory gives, and quantized files to their exact dequantization."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gguf_writer import gguf_name, llama_cpp_permute, write_gguf
from quickdraft.kernels import KERNEL_TYPES, QuantizedWeight
from quickdraft.model.build import build_transformer
from quickdraft.weights import hf_dir
from quickdraft.weights.gguf_file import read_gguf
from quickdraft.weights.gguf_reader import GGUFFile
from tiny_models import BASE, hf_model, save_hf_dir

VOCAB = BASE["vocab_size"]
F32_CASES = ["llama-gqa-untied", "llama-mha-tied", "qwen2-qkv-bias", "llama3-rope-scaling", "llama-attention-bias",
             "llama-mlp-bias", "llama-both-biases", "llama-rope-linear", "qwen3-qk-norm", "olmo2-post-norm"]
QUANT_CASES = ["llama-gqa-untied", "llama-mha-tied", "qwen2-qkv-bias", "llama-both-biases"]
QTYPES = [GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
          GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


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
                  "rope_theta", "qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings", "norm", "qk_norm"):
        assert getattr(c, field) == getattr(ref_c, field), field
    assert c.rms_norm_eps == pytest.approx(ref_c.rms_norm_eps, rel=1e-6)  # stored as float32
    if ref_c.rope_scaling is not None and ref_c.rope_scaling.kind == "linear":  # llama3's: a rope_freqs tensor
        assert c.rope_scaling == ref_c.rope_scaling

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
    ckpt = read_gguf(tmp_path / "model.gguf", quantized=False)
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

    # Kept as stored: the same values, multiplied by the integer kernel with int8 activations.
    as_stored = read_gguf(tmp_path / "model.gguf")
    for key, value in expected.items():
        w = as_stored.tensors[key]
        assert isinstance(w, QuantizedWeight) == (qtype in KERNEL_TYPES and value.ndim == 2), key
        assert torch.equal(w.dequantize() if isinstance(w, QuantizedWeight) else w, value), key
    quantized = logits_of(build_transformer(as_stored.config, as_stored.tensors), tokens)
    ref = logits_of(reference, tokens)
    assert (quantized - ref).abs().max() <= 2e-3 * ref.abs().max()  # int16 activations: ~1e-4


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


def test_header_reader_agrees_with_ggufs_and_refuses_a_cut_vocabulary(tmp_path):
    """Our header reader (string arrays in one loop) reads what gguf's GGUFReader reads, and a file
    cut inside its vocabulary is an error naming where, not a list of garbage tokens."""
    path = tmp_path / "vocab.gguf"
    tokens = ["a", "bc", "Ġd", "ü€", "", "<|endoftext|>"] * 50
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b", "Ġ d"])
    writer.add_uint32("test.count", 7)
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        field = theirs.fields[key]
        assert ours.fields[key] == [bytes(field.parts[i]).decode() for i in field.data]
    assert ours.fields["tokenizer.ggml.tokens"] == tokens and ours.fields["test.count"] == 7
    data = path.read_bytes()
    cut = data.index(b"<|endoftext|>") + 5  # inside the first long token's bytes
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="the file ends inside its header .* in an array of strings"):
        GGUFFile(tmp_path / "cut.gguf")
