"""--quantize int8|int4: float matrices become Q8_0 / Q4_1 blocks at load (gguf's quantizers), the
model built from them runs on the integer kernel, and `quickdraft info` reports that kernel."""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import quickdraft
import tiny_tokenizer
from gguf_writer import write_gguf
from quickdraft.cli import main
from quickdraft.errors import ModelLoadError
from quickdraft.kernels import QuantizedWeight
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.weights import activations, load_model, resolve_model
from quickdraft.weights.activations import activation_bits
from quickdraft.weights.quantize import quantize_tensors
from tiny_models import hf_model, save_hf_dir
from tiny_tokenizer import save_tokenizer


@pytest.mark.parametrize("scheme, qtype, tol", [("int8", GGMLQuantizationType.Q8_0, 0.02),
                                                ("int4", GGMLQuantizationType.Q4_1, 0.3)])
def test_quantize_keeps_gguf_blocks_of_the_float_matrices(scheme, qtype, tol):
    hf = hf_model("llama-gqa-untied")
    tensors = dict(hf.state_dict())
    out = quantize_tensors(tensors, scheme)
    name = "model.layers.0.mlp.up_proj.weight"
    w = out[name]
    assert isinstance(w, QuantizedWeight) and w.types == qtype.name
    expected = dequantize(quantize(tensors[name].numpy(), qtype), qtype)
    assert torch.equal(w.dequantize(), torch.from_numpy(expected))
    assert isinstance(out["model.embed_tokens.weight"], torch.Tensor)  # read a row at a time: kept
    assert torch.equal(out["model.norm.weight"], tensors["model.norm.weight"])

    config = ModelConfig.from_hf(hf.config.to_dict())
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = [m(tokens, torch.arange(12)[None], m.new_cache(1, 12)).logits
              for m in (build_transformer(config, out), build_transformer(config, tensors))]
    assert (logits[0] - logits[1]).abs().max() <= tol * logits[1].abs().max()


def test_quantize_at_load_and_its_errors(tmp_path):
    path = save_hf_dir(hf_model("qwen2-qkv-bias"), tmp_path / "hf")
    save_tokenizer(path)
    loaded = load_model(path, quantize="int4")
    assert loaded.model.weight_format == "Q4_1, int16 activations"
    assert load_model(path).model.weight_format == "float32"
    with pytest.raises(ModelLoadError, match="must be one of int8, int4"):
        load_model(path, quantize="int3")
    with pytest.raises(ModelLoadError, match="cannot be combined"):
        load_model(path, quantize="int8", dequantize=True)
    with pytest.raises(ModelLoadError, match="whole groups of 32"):
        quantize_tensors({"lm_head.weight": torch.zeros(4, 40)}, "int8")


def test_activation_precision_is_chosen_at_load(tmp_path):
    """int8 activations where asked (or measured as the model's default), int16 otherwise; the
    choice reaches every quantized matrix and changes what the model computes."""
    path = save_hf_dir(hf_model("qwen2-qkv-bias"), tmp_path / "hf")
    save_tokenizer(path)
    int16, int8 = (load_model(path, quantize="int4", activations=a).model for a in ("int16", "int8"))
    assert load_model(path, quantize="int4").model.weight_format == "Q4_1, int16 activations"
    assert int8.weight_format == "Q4_1, int8 activations"
    assert all(w.activation_bits == 8 for m in int8.modules() for w in vars(m).values()
               if isinstance(w, QuantizedWeight))
    tokens = torch.arange(3, 15)[None]
    logits = [m(tokens, torch.arange(12)[None], m.new_cache(1, 12)).logits for m in (int16, int8)]
    assert 0 < (logits[0] - logits[1]).abs().max() <= 0.05 * logits[0].abs().max()
    with pytest.raises(ModelLoadError, match="activations must be one of int16, int8, not 'int4'"):
        load_model(path, quantize="int4", activations="int4")
    with pytest.raises(ModelLoadError, match="applies to quantized matrices"):  # float weights: not a no-op
        quickdraft.load(path, activations="int8")


def test_the_activation_precision_is_measured_once_per_file_and_follows_its_content(tmp_path, monkeypatch):
    """A GGUF's int8/int16 choice is measured at its first load against the rule's thresholds,
    recorded by content (a copy elsewhere reuses it, measuring nothing), and the packaged files'
    are known; a draft loads with the precision asked for its target."""
    monkeypatch.setattr(activations, "_records", lambda: tmp_path / "activations.json")
    hf = hf_model("llama-gqa-untied")
    target = tiny_tokenizer.write_llama_gguf(hf, tmp_path / "target.gguf")
    quantized, copy, other = tmp_path / "q.gguf", tmp_path / "elsewhere.gguf", tmp_path / "other.gguf"
    for path, model in ((quantized, hf), (other, hf_model("llama-gqa-untied", seed=1))):
        write_gguf(model, path, GGMLQuantizationType.Q4_1,
                   metadata=lambda w: tiny_tokenizer._add_tokenizer(w, hf.config.vocab_size))
    copy.write_bytes(quantized.read_bytes())
    assert activation_bits(resolve_model(quantized), None) is None  # not measured yet
    assert activation_bits(resolve_model(quantized), "int8") == 8
    monkeypatch.setattr(activations, "TOP1", 0.0)                    # any agreement passes: int8
    assert load_model(quantized).model.weight_format == "Q4_1, int8 activations"
    monkeypatch.setattr(activations, "TOP1", 1.01)                   # none does: int16
    assert load_model(other).model.weight_format == "Q4_1, int16 activations"
    monkeypatch.setattr(activations, "choose_bits", lambda *a: pytest.fail("measured again"))
    assert activation_bits(resolve_model(copy), None) == 8 and activation_bits(resolve_model(other), None) == 16
    assert load_model(copy).model.weight_format == "Q4_1, int8 activations"
    assert activation_bits(resolve_model("smollm2-135m"), None) == 16  # measured with bench quality
    llm = quickdraft.load(quantized, activations="int16")
    assert llm.draft_model(str(copy)).model.weight_format == "Q4_1, int16 activations"  # not its int8 choice
    assert quickdraft.load(target, quantize="int4", activations="int8").draft_model(str(target)).model.quantized is False


def test_set_activation_bits_switches_every_matrix_and_repacks_the_fused_layers(tmp_path):
    hf = hf_model("llama-gqa-untied")
    path = tmp_path / "q.gguf"
    write_gguf(hf, path, GGMLQuantizationType.Q8_0, metadata=lambda w: tiny_tokenizer._add_tokenizer(w, hf.config.vocab_size))
    int16, int8 = load_model(path, activations="int16").model, load_model(path, activations="int8").model
    tokens, positions = torch.arange(3, 15)[None], torch.arange(12)[None]
    expected = int8(tokens, positions, int8.new_cache(1, 12)).logits
    int16(tokens, positions, int16.new_cache(1, 12))  # packs its fused layers with int16
    activations.set_activation_bits(int16, 8)
    assert int16.weight_format == "Q8_0, int8 activations"
    assert torch.equal(int16(tokens, positions, int16.new_cache(1, 12)).logits, expected)


def test_info_reports_the_active_kernel(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kernel"]["isa"] in ("avx2", "avx512vnni") and info["kernel"]["status"].startswith("built")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert f"kernel: {info['kernel']['isa']}" in capsys.readouterr().out
