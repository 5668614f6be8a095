"""Tiny random checkpoints of every family made inside the tests (never downloaded)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from quickdraft.kernels import QuantizedWeight
from quickdraft.kernels.quantized import Part
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer
from quickdraft.weights.activations import with_activation_bits
from quickdraft.weights.names import unstack_experts

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "llama-gqa-untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama-mha-tied": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0,
                                                  original_max_position_embeddings=32)),
    "llama-rope-linear": dict(model_type="llama", rope_scaling=dict(rope_type="linear", factor=4.0)),
    # YaRN over an original context of 16 (the tests' sequences are longer); its attention factor 1.14
    "llama-yarn": dict(model_type="llama", rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                             original_max_position_embeddings=16)),
    # YaRN with its own ramp and attention factor (written to GGUF as yarn_beta_* and yarn_attn_factor)
    "llama-yarn-betas": dict(model_type="llama", rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=8.0,
                                                                   beta_slow=2.0, attention_factor=1.3,
                                                                   original_max_position_embeddings=16)),
    # dynamic NTK: default RoPE within its 48 positions (the tests' sequences fit), another base past them
    "llama-dynamic": dict(model_type="llama", max_position_embeddings=48,
                          rope_scaling=dict(rope_type="dynamic", factor=4.0)),
    "qwen2-qkv-bias": dict(model_type="qwen2", tie_word_embeddings=True, num_key_value_heads=1),
    "llama-attention-bias": dict(model_type="llama", attention_bias=True),  # q, k, v and o biases
    "llama-mlp-bias": dict(model_type="llama", mlp_bias=True, tie_word_embeddings=True),
    "llama-both-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "llama-gelu-tanh": dict(model_type="llama", hidden_act="gelu_pytorch_tanh"),
    "qwen2-gelu-erf": dict(model_type="qwen2", hidden_act="gelu", tie_word_embeddings=True),
    # prompts of the tests are longer than these windows
    "mistral-window": dict(model_type="mistral", sliding_window=8),
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True),
    "qwen3-window-layer": dict(model_type="qwen3", head_dim=16, attention_bias=True, use_sliding_window=True,
                               sliding_window=6, max_window_layers=1),  # layer 1 sliding, layer 0 full
    "olmo2-post-norm": dict(model_type="olmo2", pad_token_id=None),
    "phi3-fused-window": dict(model_type="phi3", sliding_window=12, pad_token_id=None),
    # LongRoPE within its original context (64: the parity tests' sequences fit), short factors apart
    "phi3-longrope": dict(model_type="phi3", pad_token_id=None, original_max_position_embeddings=64,
                          rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0],
                                            long_factor=[2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])),
    # layers 0-4 sliding (window 6, RoPE base 10^4), layer 5 full (base 10^6); query_pre_attn_scalar
    # = head_dim as in every Gemma 3 but 27B (GGUF does not record it); untied: tied, a tiny random
    # Gemma repeats its input token (its embeddings, scaled by 8, dominate)
    # soft-caps small enough to bite; layers 0, 2 sliding (window 6), 1, 3 full
    "gemma2-softcap": dict(model_type="gemma2", num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           tie_word_embeddings=False),
    "gemma3-sandwich": dict(model_type="gemma3_text", num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=6, rope_theta=1e6, tie_word_embeddings=False),
}
# mixtures of experts (tests/test_moe.py): 2 layers of 8 (Qwen3-MoE) or 4 (Mixtral) experts, top-2
MOE_CONFIGS = {
    "qwen3moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True),
    # transformers' default: the top-k weights as the softmax gave them (llama.cpp renormalizes every
    # qwen3moe GGUF, so this one is safetensors only)
    "qwen3moe-unnormalized": dict(model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, norm_topk_prob=False, attention_bias=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    # gpt-oss: layer 0 sliding (window 6), layer 1 full; YaRN over an original context of 16 (unrounded
    # ramp); sinks, the router's and experts' biases random (below)
    "gptoss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                   sliding_window=6, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                          truncate=False, original_max_position_embeddings=16,
                                                          rope_theta=10000.0)),
}
# the families other than Llama and Qwen2, built through transformers' Auto classes
NEW_FAMILIES = [name for name, cfg in CONFIGS.items()
                if cfg["model_type"] not in ("llama", "qwen2") and name != "phi3-longrope"]  # no GGUF of it


def hf_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = {**BASE, **(CONFIGS | MOE_CONFIGS)[name], **overrides}
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
        with torch.no_grad():  # random biases, so the test sees them (HF initialises them to 0)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif model_type != "llama":
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
        with torch.no_grad():  # attention_bias (gpt-oss: every bias, and its sinks): random, as for Llama's
            for n, p in model.named_parameters():
                if n.endswith((".bias", "_bias", "sinks")):
                    p.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        with torch.no_grad():  # attention_bias / mlp_bias: random, as for Qwen2's
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.5)
    with torch.no_grad():  # norms away from 1 so a wrong norm weight is caught
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
                if model_type.startswith("gemma"):
                    p.sub_(1.0)  # Gemma stores gain - 1: the same gains as the other families
    return model.eval()


@torch.inference_mode()
def transformers_greedy(hf: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model, each from one full forward (no cache of its own)."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as its checkpoints hold them: the state dict, but for experts, which
    transformers 5 stacks in memory ([E, ...]) and save_pretrained writes one matrix per expert."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not any(k.endswith("experts.gate_up_proj") for k in sd):
        return sd
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return dict(load_file(f"{tmp}/model.safetensors"))


def mxfp4_experts(model: torch.nn.Module) -> torch.nn.Module:
    """gpt-oss's expert matrices replaced by their MXFP4 values (gguf's quantization, blocks of 32
    along each matrix's input), in place: transformers then runs the numbers an MXFP4 file stores."""
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):  # x @ W: [E, in, out]
                rows = w.transpose(1, 2).float().numpy()
                values = dequantize(quantize(rows, GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)
                w.copy_(torch.from_numpy(values.reshape(rows.shape)).transpose(1, 2))
    return model


def save_mxfp4_dir(model: torch.nn.Module, path: Path) -> Path:
    """config.json + model.safetensors as gpt-oss's published checkpoints hold them: each stacked expert
    matrix as `_blocks` [E, out, in/32, 16] (two FP4 codes a byte, the even element low) and `_scales`
    [E, out, in/32] (E8M0), quantization_config mxfp4; written from gguf's MXFP4 quantization of the
    matrices (mxfp4_experts' values are held exactly). Transformers reads these files on its own."""
    save_hf_dir(model, path)
    sd = load_file(str(path / "model.safetensors"))
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = sd.pop(name).transpose(1, 2).float().contiguous().numpy()  # x @ W [E, in, out] -> [E, out, in]
        e, n, k = rows.shape
        q = quantize(rows.reshape(e * n, k), GGMLQuantizationType.MXFP4).reshape(e, n, k // 32, 17)
        codes = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)  # GGUF: low nibbles 0-15, high 16-31
        sd[name + "_blocks"] = torch.from_numpy((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8))
        sd[name + "_scales"] = torch.from_numpy(q[..., 0].copy())
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def save_hf_dir(model: torch.nn.Module, path: Path) -> Path:
    """config.json + model.safetensors, as save_pretrained writes them."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    (path / "config.json").write_text(json.dumps(cfg))
    sd = checkpoint_tensors(model)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(path / "model.safetensors"))
    return path


K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}


def random_k_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, std: float, seed: int) -> np.ndarray:
    """K-quant blocks (gguf cannot quantize to them) with random quants and scales, the superblock
    scales set so the values have mean ~0 and about `std`: a random weight stored as llama.cpp's
    Q4_K_M files store theirs."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def put(offset: int, value: float) -> None:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    if qtype == GGMLQuantizationType.Q6_K:
        put(208, std / 1330)  # std of sc * (q - 32) for uniform int8 sc, 6-bit q
    else:
        d = std / (200 if qtype == GGMLQuantizationType.Q4_K else 400)
        put(0, d)
        put(2, d * (7.5 if qtype == GGMLQuantizationType.Q4_K else 15.5))  # mean q: centres the values
    return raw.reshape(rows, -1)


def quantized_tensors(tensors: dict[str, torch.Tensor], qtype: GGMLQuantizationType) -> dict:
    """Projection and output matrices as `qtype` blocks: gguf's quantization of the float weights,
    or random K-quant blocks of the same spread."""
    out = dict(tensors)
    for i, (name, w) in enumerate(sorted(tensors.items())):
        if w.ndim == 2 and name.endswith(("proj.weight", "lm_head.weight")):
            blocks = (random_k_blocks(*w.shape, qtype, float(w.std()), seed=i) if qtype in K_QUANTS
                      else quantize(w.float().numpy(), qtype))
            out[name] = QuantizedWeight([Part(qtype, blocks)], w.shape[1])
    return out


def ours_from_hf(model: torch.nn.Module, dtype: torch.dtype = torch.float32,
                 qtype: GGMLQuantizationType | None = None, activation_bits: int = 16) -> Transformer:
    """Our model of the same weights; with `qtype`, its matrices held as those GGUF blocks,
    multiplying activations rounded to `activation_bits`."""
    config = ModelConfig.from_hf(model.config.to_dict())
    tensors = unstack_experts(checkpoint_tensors(model), config.family)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embeddings again, as save_hf_dir leaves it out
    if qtype is not None:
        tensors = with_activation_bits(quantized_tensors(tensors, qtype), activation_bits)
    return build_transformer(config, tensors, dtype=dtype)
