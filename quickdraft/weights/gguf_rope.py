"""A GGUF file's RoPE: its `{arch}.rope.*` keys and rope tensors, as llama.cpp's converter writes
them from a Hugging Face config, read into the RopeScaling transformers computes for that config.

Every rope key is read, known to change nothing, or refused by name (UnsupportedArchitecture).
Where llama.cpp reads less than the file says (its `llama`-like architectures ignore the yarn_*
keys the converter writes from the config), the file's word is taken: it is the model's.
Knows GGUF metadata and the rope tensors' values, nothing of the other tensors or of models.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from quickdraft.errors import ModelLoadError, UnsupportedArchitecture
from quickdraft.model.config import RopeScaling, yarn_attention_factor
from quickdraft.model.families import Family

# tensors that are RoPE settings, not weights: rope_freqs divides the frequencies (Llama 3's
# scaling); Phi-3's LongRoPE factors (long: past the original context, short: within it)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")

# rope keys read elsewhere (gguf_file.py) or that change nothing here: the base; the rotated width
# (checked to be the head's); the original context outside YaRN and LongRoPE (llama.cpp reads it
# for those only); whether the model was fine-tuned with its scaling (informational)
_READ_ELSEWHERE = ("rope.freq_base", "rope.dimension_count", "rope.dimension_count_swa",
                   "rope.scaling.original_context_length", "rope.scaling.finetuned")
_YARN = ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
         "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor")
# read below: the type, the factor (and its older name), the attention factor, Gemma 3's local base
_READ_HERE = ("rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
              "rope.freq_base_swa") + _YARN


def rope_scaling(meta: Mapping[str, Any], arch: str, spec: Family, context: int,
                 tensors: Mapping[str, np.ndarray]) -> tuple[RopeScaling | None, int]:
    """(the scaling, the context the model runs in) from the metadata and the file's rope tensors
    (`tensors`: those of ROPE_TENSORS it has, by name)."""
    key = _keys(meta, arch, spec)
    kind = key("rope.scaling.type")
    factor = next((float(key(k)) for k in ("rope.scaling.factor", "rope.scale_linear")
                   if key(k) not in (None, 0.0, 1.0)), None)
    longrope = [name for name in _LONGROPE if name in tensors]
    if kind not in (None, "none", "linear", "yarn", "longrope"):
        raise UnsupportedArchitecture(f"GGUF key '{arch}.rope.scaling.type' = {kind!r} is not supported; expected "
                                      f"none, linear, yarn or longrope")
    _refuse_other_kinds_keys(key, arch, "yarn" if kind == "yarn" else "longrope" if longrope else kind)
    if "rope_freqs.weight" in tensors and (kind in ("yarn", "longrope") or longrope):
        raise UnsupportedArchitecture(f"GGUF tensor 'rope_freqs.weight' with rope scaling "
                                      f"{'yarn' if kind == 'yarn' else 'longrope'!r} is not supported")
    if kind == "yarn":
        return _yarn(key, arch, factor, context, tensors, spec.gguf_yarn_truncate), context
    if longrope or kind == "longrope":
        return _longrope(key, arch, factor, context, tensors, longrope)
    if kind in (None, "linear") and factor is not None:
        return RopeScaling("linear", factor), context
    if factor is not None:
        raise UnsupportedArchitecture(
            f"GGUF rope scaling type {kind!r} with factor {factor!r} is not supported; expected none or linear "
            f"(llama3-style scaling comes as a rope_freqs tensor)")
    return None, context


def _keys(meta: Mapping[str, Any], arch: str, spec: Family):
    """key(name) -> the value of `{arch}.{name}` (None if absent); refuses a rope key no one reads."""
    known = set(_READ_ELSEWHERE + _READ_HERE)
    unknown = sorted(k for k in meta if k.startswith(f"{arch}.rope.") and k[len(arch) + 1:] not in known)
    if unknown:
        raise UnsupportedArchitecture(f"GGUF key {unknown[0]!r} = {meta[unknown[0]]!r} is not supported (a RoPE "
                                      f"setting this decoder does not implement)")
    swa, base = meta.get(f"{arch}.rope.freq_base_swa"), meta.get(f"{arch}.rope.freq_base", 10000.0)
    if swa is not None and not spec.rope_per_layer_type and float(swa) != float(base):
        raise UnsupportedArchitecture(f"GGUF key '{arch}.rope.freq_base_swa' = {swa!r} (a RoPE base of sliding "
                                      f"layers of their own) is not supported for '{arch}'")
    return lambda name: meta.get(f"{arch}.{name}")


def _refuse_other_kinds_keys(key, arch: str, kind: str | None) -> None:
    """Settings of a scaling the file does not use, at values that would change the math, refused by
    name (llama.cpp applies rope.scaling.attn_factor under every type; a YaRN extrapolation factor
    other than 1 is none of transformers')."""
    neutral = {"rope.scaling.attn_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
               "rope.scaling.yarn_log_multiplier": 0.0, "rope.scaling.yarn_ext_factor": 0.0}
    if kind == "yarn":
        neutral = {"rope.scaling.yarn_ext_factor": 1.0}  # the others are YaRN's own
    elif kind == "longrope":
        del neutral["rope.scaling.attn_factor"]  # LongRoPE's own
    for name, value in neutral.items():
        if key(name) is not None and float(key(name)) != value:
            raise UnsupportedArchitecture(f"GGUF key '{arch}.{name}' = {key(name)!r} is not supported with rope "
                                          f"scaling {kind or 'none'!r}")


def _yarn(key, arch: str, factor: float | None, context: int, tensors: Mapping[str, np.ndarray],
          truncate: bool) -> RopeScaling:
    """YaRN as the converter writes it: the factor and original context always, the attention
    factor and betas where the config had them (else transformers' defaults); llama.cpp's
    yarn_log_multiplier is transformers' mscale_all_dim (with mscale 1); rope.scaling.attn_factor
    multiplies the cos/sin scale, as in llama.cpp. `truncate`: the family's (the file does not say;
    gpt-oss's checkpoints do not round the correction range, which llama.cpp rounds)."""
    if factor is None:
        raise ModelLoadError(f"GGUF rope scaling type 'yarn' needs '{arch}.rope.scaling.factor' greater than 1")
    if any(name in tensors for name in _LONGROPE):
        raise UnsupportedArchitecture(f"GGUF rope scaling type 'yarn' with LongRoPE's tensors {list(_LONGROPE)} "
                                      f"is not supported")
    attention = key("rope.scaling.yarn_attn_factor")
    if attention is None:
        log_mul = float(key("rope.scaling.yarn_log_multiplier") or 0.0)
        attention = yarn_attention_factor(factor, 1.0 if log_mul else None, log_mul or None)
    return RopeScaling("yarn", factor, original_max_position_embeddings=int(
                           key("rope.scaling.original_context_length") or context),
                       beta_fast=float(key("rope.scaling.yarn_beta_fast") or 32.0),
                       beta_slow=float(key("rope.scaling.yarn_beta_slow") or 1.0),
                       attention_factor=float(attention) * float(key("rope.scaling.attn_factor") or 1.0),
                       truncate=truncate)


def _longrope(key, arch: str, factor: float | None, context: int, tensors: Mapping[str, np.ndarray],
              present: list[str]) -> tuple[RopeScaling, int]:
    """Phi-3's LongRoPE as the converter writes it (no scaling type; the type longrope from other
    architectures' converters): both factor tensors, the original context and the attention
    factor. It runs within the original context with the short factors, as the safetensors
    model does (model/config.py says why)."""
    if len(present) != 2:
        raise UnsupportedArchitecture(f"GGUF LongRoPE needs both tensors {list(_LONGROPE)}; found {present}")
    if factor is not None:
        raise UnsupportedArchitecture(f"GGUF LongRoPE with '{arch}.rope.scaling.factor' {factor!r} is not supported")
    long, short = (tuple(float(f) for f in np.asarray(tensors[n]).reshape(-1)) for n in _LONGROPE)
    if len(long) != len(short):
        raise ModelLoadError(f"GGUF LongRoPE factors: {len(long)} long and {len(short)} short; expected as many")
    original = int(key("rope.scaling.original_context_length") or context)
    return RopeScaling("longrope", context / original, original_max_position_embeddings=original,
                       attention_factor=float(key("rope.scaling.attn_factor") or 1.0),
                       short_factor=short), min(context, original)
