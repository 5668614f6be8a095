"""Tiny random Llama-family checkpoints made inside the tests (never downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer, build_transformer

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
    "qwen2-qkv-bias": dict(model_type="qwen2", tie_word_embeddings=True, num_key_value_heads=1),
}


def hf_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = {**BASE, **CONFIGS[name], **overrides}
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
        with torch.no_grad():  # random biases, so the test sees them (HF initialises them to 0)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():  # norms away from 1 so a wrong norm weight is caught
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model.eval()


def save_hf_dir(model: torch.nn.Module, path: Path) -> Path:
    """config.json + model.safetensors, as save_pretrained writes them."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(path / "model.safetensors"))
    return path


def ours_from_hf(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> Transformer:
    config = ModelConfig.from_hf(model.config.to_dict())
    return build_transformer(config, dict(model.state_dict()), dtype=dtype)
