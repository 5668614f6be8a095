"""The one name-mapping table: Hugging Face tensor names <-> GGUF (llama.cpp) tensor names, and
the tensors some checkpoints carry that hold nothing the model needs (each with the reason).

The model is built from Hugging Face names and refuses a tensor it does not take; the GGUF loader
renames through this table and keeps a name outside it as it is, so that refusal names it.
"""
from __future__ import annotations

import re

# (Hugging Face name, GGUF name); "{i}" is the layer index.
TENSOR_NAMES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    ("model.layers.{i}.mlp.gate_proj.bias", "blk.{i}.ffn_gate.bias"),
    ("model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias"),
    ("model.layers.{i}.mlp.down_proj.bias", "blk.{i}.ffn_down.bias"),
)

# Hugging Face tensors that are dropped at load, and why. (GGUF's `rope_freqs.weight` is no such
# tensor: it divides the RoPE frequencies, weights/gguf_file.py.)
IGNORED_TENSORS: tuple[tuple[str, str], ...] = (
    ("model.layers.{i}.self_attn.rotary_emb.inv_freq",
     "RoPE inverse frequencies older transformers saved as buffers; computed from the config instead"),
    ("model.rotary_emb.inv_freq", "the same, saved once for the model"),
)


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_GGUF_TO_HF = [(_pattern(gguf), hf) for hf, gguf in TENSOR_NAMES]
_IGNORED = [_pattern(hf) for hf, _ in IGNORED_TENSORS]


def ignored(name: str) -> bool:
    """Whether a Hugging Face tensor is one of IGNORED_TENSORS."""
    return any(pattern.match(name) for pattern in _IGNORED)


def hf_name_for_gguf(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for a name outside the table."""
    for pattern, hf in _GGUF_TO_HF:
        m = pattern.match(name)
        if m:
            return hf.replace("{i}", m.group(1)) if m.groups() else hf
    return None
