"""Writing tiny HF models as GGUF files the way llama.cpp's converter does (its metadata keys,
tensor names through the family's row, its q/k row permutation for "llama", every expert's matrix
of a layer stacked in one tensor), for the tests."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from quickdraft.model.families import FAMILIES, gguf_family
from quickdraft.weights.names import gguf_name_for_hf, unstack_experts
from tiny_models import checkpoint_tensors


def gguf_name(hf: str, model_type: str = "llama") -> str:
    """The GGUF name of a Hugging Face tensor of a family, through its row (families.py)."""
    name = gguf_name_for_hf(hf, FAMILIES[model_type])
    assert name is not None, hf
    return name


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for interleaved RoPE."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_parameters(cfg) -> dict:
    """transformers 5 keeps rope_theta and the scaling under `rope_parameters`."""
    d = cfg.to_dict()
    params = d.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # Gemma 3: the global layers' (the converter's freq_base)
    return {"rope_theta": d.get("rope_theta"), **(d.get("rope_scaling") or {}), **params}


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


def write_rope_scaling(writer: gguf.GGUFWriter, cfg, arch: str) -> dict[str, np.ndarray]:
    """The RoPE scaling keys and tensors the converter writes (conversion/base.py's
    set_gguf_parameters; llama.py's rope_freqs for llama3; phi.py's LongRoPE factors); dynamic NTK
    it writes nothing for. Returns the tensors written."""
    rope = rope_parameters(cfg)
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None and arch != "gpt-oss":  # (gpt_oss.py writes the factor and context only)
                add(rope[key])
    tensors = {}
    if kind == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg)
    if kind in ("longrope", "su") and arch == "phi3":
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    return tensors


def _stacked_experts(sd: dict) -> dict[str, np.ndarray]:
    """float32 tensors by HF name, each layer's expert matrices stacked in expert order ([E, rows,
    cols]) under the name with "{e}" for the expert, as the converter stacks them."""
    out: dict[str, np.ndarray | dict[int, np.ndarray]] = {}
    for name, tensor in sd.items():
        m = re.search(r"\.experts\.(\d+)\.", name)
        if m is None:
            out[name] = tensor.float().numpy()
        else:
            out.setdefault(name.replace(m.group(0), ".experts.{e}."), {})[int(m.group(1))] = tensor.float().numpy()
    return {name: np.stack([w[e] for e in sorted(w)]) if isinstance(w, dict) else w for name, w in out.items()}


def write_gguf(hf, path: Path, qtype: GGMLQuantizationType | None = None, arch: str | None = None,
               metadata: Callable[[gguf.GGUFWriter], None] | None = None,
               window: int | None = None, expert_qtype: GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """Write `hf` as llama.cpp would; matrices (but routers) quantized to `qtype` when given, 1-D kept F32;
    the experts' matrices to `expert_qtype` (default: qtype; gpt-oss's files: MXFP4).
    `arch` overrides general.architecture (to write unsupported ones); `metadata` adds more keys
    (a tokenizer); `window` writes `attention.sliding_window` (llama.cpp's Phi-3 converter does; for
    Mistral, which it writes as "llama" without it, the file is then the windowed model). Returns what was stored per GGUF name (quantized bytes where quantized)."""
    cfg = hf.config
    family = FAMILIES[cfg.model_type]
    arch = arch or family.gguf_arch or "llama"  # Mistral: "llama", as llama.cpp writes it
    names = gguf_family(arch, family.moe) if (arch, family.moe) in {(f.gguf_arch, f.moe) for f in FAMILIES.values()} \
        else family
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    window = window or (cfg.sliding_window if arch == "gpt-oss" else None)  # gpt_oss.py writes it always
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
    if family.moe:  # as the converter writes them (Qwen MoE: an expert's width apart from the dense one)
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if family.gguf_expert_size_key:
            writer.add_expert_feed_forward_length(getattr(cfg, family.expert_size_key))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's, as the converter writes them
        if getattr(cfg, key, None) and arch == "gemma2":
            getattr(writer, f"add_{key}")(getattr(cfg, key))
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if window:
        writer.add_sliding_window(window)
        types = getattr(cfg, "layer_types", None)
        if types and "full_attention" in types and not arch.startswith(("gemma", "gpt-oss")):  # as the converter
            # writes OLMo 3's (Gemma's and gpt-oss's write none: llama.cpp takes every 2nd (Gemma 2, gpt-oss) or
            # 6th (Gemma 3) layer as full)
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if metadata is not None:
        metadata(writer)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else {
        GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
        GGMLQuantizationType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
        GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
        GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
        GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])

    stored: dict[str, np.ndarray] = {}
    sd = unstack_experts(checkpoint_tensors(hf), family)  # (gpt-oss: gate and up apart, as gpt_oss.py writes them)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied checkpoints have no output.weight
    for name, w in _stacked_experts(sd).items():
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1  # the converter stores Gemma's norm gains, 1 + w
        gguf_name = gguf_name_for_hf(name.replace("{e}", "0"), names)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        to = expert_qtype if expert_qtype and "{e}" in name else qtype
        if to is not None and w.ndim >= 2 and not gguf_name.endswith(("ffn_gate_inp.weight", ".bias")):
            # (routers and biases stay F32)
            data = quantize(w, to)
            writer.add_tensor(gguf_name, data, raw_dtype=to)
        else:
            data = np.ascontiguousarray(w, dtype=np.float32)
            writer.add_tensor(gguf_name, data)
        stored[gguf_name] = data
    stored |= write_rope_scaling(writer, cfg, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
