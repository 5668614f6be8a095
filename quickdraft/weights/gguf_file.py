"""Loading a single GGUF file: config and tokenizer metadata, and tensors either kept in their
block formats (`QuantizedWeight`, a view of the memory-mapped file) or dequantized with `gguf`.

The architecture, and whether the file has experts (Mixtral is "llama" with experts), picks the
family's row (model/families.py): its tensor names, and whether llama.cpp stored the q/k
projections permuted for its interleaved RoPE (`llama`); they are permuted back here (whole rows of
blocks, so quantized rows move unchanged) so the model has one RoPE layout for every format. A
stacked expert tensor ([E, rows, cols]) becomes one matrix per expert, each a view of the file's
blocks where the kernel runs their type, as every matrix is. Every tensor is handed on (one outside
the family's names under its own name, for the model to refuse by name), and metadata that changes
the math is read or refused, never assumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from quickdraft.errors import ModelLoadError, UnsupportedArchitecture
from quickdraft.kernels.quantized import KERNEL_TYPES, Part, QuantizedWeight
from quickdraft.model.config import ModelConfig
from quickdraft.model.families import HIDDEN_ACTS, Family, gguf_family
from quickdraft.weights.gguf_reader import GGUFFile
from quickdraft.weights.gguf_rope import ROPE_TENSORS, rope_scaling
from quickdraft.weights.names import hf_name_for_gguf


@dataclass
class GGUFCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor | QuantizedWeight]  # Hugging Face names; float32 or as stored
    metadata: dict[str, Any]          # every key-value field (tokenizer.ggml.*, chat template...)
    rope_freq_factors: torch.Tensor | None


def open_reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        return GGUFFile(path)
    except Exception as e:  # ValueError, struct errors, bad UTF-8... on damage
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (expected magic 'GGUF' and a complete header): "
            f"{type(e).__name__}: {e}") from None


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    return {key: value for key, value in reader.fields.items() if not key.startswith("GGUF.")}


# Keys llama.cpp reads (for some architecture) that change the math this decoder does, with the
# value that leaves it unchanged. A file of ours with another value is another model.
NEUTRAL_KEYS: dict[str, tuple[Any, str]] = {
    "expert_count": (0, "a mixture of experts"),
    "attn_logit_softcapping": (0.0, "soft-capped attention scores"),
    "final_logit_softcapping": (0.0, "soft-capped logits"),
    "logit_scale": (1.0, "scaled logits"),
    "embedding_scale": (1.0, "scaled embeddings"),
    "residual_scale": (1.0, "scaled residuals"),
    "attention.scale": (0.0, "an attention scale other than 1/sqrt(head_dim)"),
    "attention.clamp_kqv": (0.0, "clamped q/k/v"),
    "attention.max_alibi_bias": (0.0, "ALiBi attention biases"),
    "attention.causal": (True, "non-causal attention"),
    "use_parallel_residual": (False, "parallel attention and MLP"),
    "expert_used_count": (0, "experts per token"),
    # llama.cpp's routing of the families with experts here: softmax, the top-k weights renormalized
    "expert_shared_count": (0, "a shared expert"),
    "expert_shared_feed_forward_length": (0, "a shared expert"),
    "expert_gating_func": (1, "expert gating other than softmax"),
    "expert_weights_norm": (True, "top-k expert weights not renormalized"),
    "expert_weights_scale": (1.0, "scaled expert weights"),
    "expert_group_count": (0, "grouped expert routing"),
    "leading_dense_block_count": (0, "dense layers before the experts"),
}
EXPERT_KEYS = ("expert_count", "expert_used_count")  # read where the family has experts
# The other `{arch}.*` keys the families' files hold, each read by config_from_metadata (or checked
# by _refuse_unsupported_keys; `{arch}.rope.*`: gguf_rope.py). A key outside these and NEUTRAL_KEYS
# may change the math in a way this loader cannot tell: refused by name.
READ_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.key_length_swa", "attention.value_length_swa", "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "expert_feed_forward_length"})


def config_from_metadata(meta: dict[str, Any], names: set[str],
                         rope_tensors: Mapping[str, np.ndarray] | None = None) -> ModelConfig:
    """The config from a file's metadata and its tensor names (biases and the output matrix are
    there or not) and values of its rope tensors (gguf_rope.ROPE_TENSORS: LongRoPE's factors);
    keys that change the math and are not implemented are refused by name."""
    arch = meta.get("general.architecture")
    spec = gguf_family(arch, experts=bool(meta.get(f"{arch}.expert_count")))
    gguf_names = {role: gguf for role, (_, gguf) in spec.names.items()}

    def has(role: str) -> bool:
        return role in gguf_names and gguf_names[role].replace("{i}", "0") in names

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks required key '{arch}.{key}'")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    _refuse_unsupported_keys(meta, arch, head_dim, spec)
    scaling, context = rope_scaling(meta, arch, spec, int(get("context_length")), rope_tensors or {})
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=spec.model_type,
        vocab_size=int(get("vocab_size", len(tokens) or None)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        qkv_bias=has("q.bias") or has("qkv.bias"),
        o_bias=has("o.bias"),
        mlp_bias=has("gate.bias") or has("down.bias"),
        activation=spec.gate or HIDDEN_ACTS[dict(spec.defaults).get(spec.activation_key, "silu")],
        norm=spec.norm,  # Gemma's converter stores its norms' gains (1 + w): no offset
        embed_scale=hidden ** 0.5 if spec.embed_scale else 1.0,
        attn_scale=_attn_scale(meta, arch, spec, hidden, heads),
        attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping") or 0.0) or None if spec.softcaps else None,
        logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0) or None if spec.softcaps else None,
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if spec.rope_per_layer_type else None,
        qk_norm=spec.qk_norm,
        attn_sinks=spec.sinks,
        layer_windows=_layer_windows(meta, arch, int(get("block_count")), spec),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=((int(eos),) if eos is not None else ()) + _end_token_ids(tokens, spec),
        **(_experts(get, spec) if spec.moe else {}),
    )


def _experts(get: Any, spec: Family) -> dict[str, Any]:
    """A mixture of experts as llama.cpp runs these families: softmax routing, the top-k weights
    renormalized (every qwen3moe and llama file; gpt-oss: the softmax of the top k logits), an
    expert's width its own key or else feed_forward_length (a qwen3moe file without it:
    feed_forward_length / experts used, as llama.cpp)."""
    count, used = int(get("expert_count")), int(get("expert_used_count"))
    size = get("feed_forward_length")
    if spec.gguf_expert_size_key:
        size = get(spec.gguf_expert_size_key, int(size) // max(used, 1))
    return dict(num_experts=count, experts_per_token=used, expert_size=int(size), norm_topk=not spec.topk_first,
                expert_weights_float32=spec.expert_weights_float32, topk_first=spec.topk_first,
                expert_biases=spec.expert_biases)


def _end_token_ids(tokens: list[str], spec: Family) -> tuple[int, ...]:
    """The ids of the family's other end-of-generation tokens this vocabulary holds."""
    index = {token: i for i, token in enumerate(tokens) if token in spec.gguf_end_tokens}
    return tuple(index[t] for t in spec.gguf_end_tokens if t in index)


def _layer_windows(meta: dict[str, Any], arch: str, layers: int, spec: Family) -> tuple[int | None, ...]:
    """`{arch}.attention.sliding_window` (0 or absent: none) on every layer, or on the layers
    `sliding_window_pattern` marks; a Gemma 3 file without it has every 6th layer full, as
    llama.cpp assumes."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if window <= 0:
        return ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None and spec.window == "pattern":
        every = int(dict(spec.defaults)["sliding_window_pattern"])
        pattern = [bool((i + 1) % every) for i in range(layers)]
    if pattern is None:
        return (window,) * layers
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise UnsupportedArchitecture(
            f"GGUF key '{arch}.attention.sliding_window_pattern' = {pattern!r} is not supported; expected "
            f"one flag per layer ({layers})")
    return tuple(window if sliding else None for sliding in pattern)


def _refuse_unsupported_keys(meta: dict[str, Any], arch: str, head_dim: int, spec: Family) -> None:
    """Metadata asking for math this decoder does not do is an UnsupportedArchitecture naming it."""
    if meta.get("general.type", "model") != "model":
        raise UnsupportedArchitecture(f"GGUF general.type {meta['general.type']!r} is not supported; expected a model "
                                      f"(a LoRA adapter's file holds no model of its own)")
    unknown = sorted(k for k in meta if k.startswith(f"{arch}.") and not k.startswith(f"{arch}.rope.")
                     and k[len(arch) + 1:] not in READ_KEYS | NEUTRAL_KEYS.keys())
    if unknown:
        raise UnsupportedArchitecture(f"GGUF key {unknown[0]!r} = {meta[unknown[0]]!r} is not supported (not a "
                                      f"setting this loader reads or knows to change nothing)")
    for key, (neutral, what) in NEUTRAL_KEYS.items():
        if key == "attention.scale" and spec.attn_scale_key or key.endswith("softcapping") and spec.softcaps \
                or key in EXPERT_KEYS and spec.moe:
            continue  # read: the family's own scale, soft-caps and experts
        value = meta.get(f"{arch}.{key}", neutral)
        if value != neutral:
            raise UnsupportedArchitecture(f"GGUF key '{arch}.{key}' = {value!r} ({what}) is not supported")
    for key, what in (("rope.dimension_count", "partial rotary embeddings"),
                      ("attention.value_length", "values of another head size than keys"),
                      ("rope.dimension_count_swa", "partial rotary embeddings in sliding layers"),
                      ("attention.key_length_swa", "another head size in sliding layers"),
                      ("attention.value_length_swa", "another head size in sliding layers")):
        value = meta.get(f"{arch}.{key}", head_dim)
        if value != head_dim:
            raise UnsupportedArchitecture(
                f"GGUF key '{arch}.{key}' = {value!r} ({what}) is not supported; expected the head size, {head_dim}")
    if f"{arch}.attention.layer_norm_rms_epsilon" not in meta and f"{arch}.attention.layer_norm_epsilon" in meta:
        raise UnsupportedArchitecture(
            f"GGUF key '{arch}.attention.layer_norm_epsilon' without '{arch}.attention.layer_norm_rms_epsilon' "
            f"(LayerNorm) is not supported; expected RMSNorm")


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's (heads, 2, hd/2) -> (heads, hd/2, 2) row permutation of q/k."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(t: Any) -> np.ndarray:
    """A reader tensor as float32 in numpy order ([out, in] for matrices)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        qtype = GGMLQuantizationType(t.tensor_type)
        values = dequantize(t.data, qtype)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has type {t.tensor_type!r} that cannot be "
                             f"dequantized: {e}") from None
    return np.asarray(values, dtype=np.float32).reshape(shape)


def read_gguf(path: Path, progress: bool = False, quantized: bool = True) -> GGUFCheckpoint:
    """`quantized`: keep matrices in the block types the kernel runs (KERNEL_TYPES) as stored;
    everything else (and everything when False) is dequantized to float32."""
    reader = open_reader(path)
    meta = read_metadata(reader)
    rope = {t.name: dequantize_tensor(t) for t in reader.tensors if t.name in ROPE_TENSORS}
    config = config_from_metadata(meta, {t.name for t in reader.tensors}, rope)
    spec = config.family
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    freq_factors = torch.from_numpy(rope["rope_freqs.weight"].copy()) if "rope_freqs.weight" in rope else None
    verb = "reading" if quantized else "dequantizing"
    for t in tqdm(reader.tensors, desc=f"{verb} GGUF", unit="tensor", disable=not progress, leave=False):
        if t.name in rope:  # read into the config (LongRoPE's factors) or passed on (rope_freqs)
            continue
        hf = hf_name_for_gguf(t.name, spec) or t.name  # a name outside the table stays: the model refuses it by name
        if "{e}" in hf:  # every expert's matrix in one tensor
            tensors |= _per_expert(t, hf, quantized)
            continue
        heads = _permuted_heads(spec, config, hf)
        if quantized and len(t.shape) == 2 and GGMLQuantizationType(t.tensor_type) in KERNEL_TYPES:
            tensors[hf] = _as_stored(t, heads)
        else:
            w = torch.from_numpy(dequantize_tensor(t).copy())
            tensors[hf] = w if heads is None else _unpermute_qk(w, heads)
    return GGUFCheckpoint(config, tensors, meta, freq_factors)


def _per_expert(t: Any, hf: str, quantized: bool) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A stacked expert tensor ([E, rows, cols], biases [E, rows]) as E matrices (vectors) under their
    Hugging Face names ("{e}" filled): views of the file's blocks where the kernel runs their type,
    else of one float32 dequantization."""
    if len(t.shape) != (2 if hf.endswith(".bias") else 3):
        raise ModelLoadError(f"GGUF tensor {t.name!r} has {len(t.shape)} dimensions; expected 3 (experts, rows, "
                             f"columns), or 2 for biases")
    if quantized and len(t.shape) == 3 and GGMLQuantizationType(t.tensor_type) in KERNEL_TYPES:
        blocks = np.asarray(t.data)  # [E, rows, row_bytes]
        try:
            return {hf.replace("{e}", str(e)): QuantizedWeight([Part(GGMLQuantizationType(t.tensor_type), blocks[e])],
                                                                int(t.shape[0])) for e in range(blocks.shape[0])}
        except ValueError as err:
            raise ModelLoadError(f"GGUF tensor {t.name!r}: {err}") from None
    w = torch.from_numpy(dequantize_tensor(t).copy())
    return {hf.replace("{e}", str(e)): w[e] for e in range(w.shape[0])}


def _permuted_heads(spec: Family, config: ModelConfig, hf: str) -> int | None:
    """The head count of a q/k tensor llama.cpp's converter permuted, None for every other tensor."""
    if spec.gguf_permuted_qk and hf.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_heads
    if spec.gguf_permuted_qk and hf.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_kv_heads
    return None


def _as_stored(t: Any, heads: int | None) -> QuantizedWeight:
    """A quantized matrix as a view of the file's blocks ([rows, row_bytes]); q/k rows reordered."""
    blocks = np.asarray(t.data)
    if heads is not None:
        order = _unpermute_qk(torch.arange(blocks.shape[0]), heads).numpy()
        blocks = blocks[order]  # the only copy: llama-architecture q and k
    try:
        return QuantizedWeight([Part(GGMLQuantizationType(t.tensor_type), blocks)], int(t.shape[0]))
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensor {t.name!r}: {e}") from None


def _attn_scale(meta: Mapping[str, Any], arch: str, spec: Family, hidden: int, heads: int) -> float | None:
    """The scores' scale: the file's `attention.scale`, else, at the layer count of Gemma's 27B
    (whose query_pre_attn_scalar, hidden / heads, differs from head_dim and which the converter does
    not record), (hidden / heads) ** -0.5 as llama.cpp computes it for those files; else None
    (head_dim ** -0.5)."""
    scale = float(meta.get(f"{arch}.attention.scale") or 0.0)
    if scale:
        return scale
    if int(meta.get(f"{arch}.block_count", 0)) == spec.gguf_unscaled_layers:
        return (hidden / heads) ** -0.5
    return None
