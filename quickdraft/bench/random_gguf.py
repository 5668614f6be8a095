"""`quickdraft bench random-gguf`: a GGUF of a real model's shape with random weights, written in
the block types its published GGUFs use, to measure speed against llama.cpp on models whose weights
we cannot download (Qwen3-30B-A3B: 17 GB as Q4_K_M; gpt-oss-20b: 12 GB).

The blocks are written directly: random quants with block scales chosen so each weight is ~1e-2,
no float copy of the model exists at any point, and the file is written tensor by tensor. Types:
Qwen3-MoE follows llama.cpp's Q4_K_M rule (Q4_K everywhere, Q6_K for the output, and for attn_v and
the (expert) down projections of the layers `more_bits` picks); gpt-oss its published MXFP4_MOE file
(MXFP4 experts, Q8_0 for every other matrix); norms, routers, biases and sinks F32. The tokenizer is
the packaged Qwen2.5-Coder-1.5B's (151,936 tokens), padded with reserved tokens to a larger
vocabulary (gpt-oss's 201,088), so both engines load it as any GGUF. Speed does not depend on the
values; only their finiteness matters.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)

from quickdraft.errors import QuickdraftError

Q4_K, Q6_K, Q8_0, MXFP4 = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0,
                           GGMLQuantizationType.MXFP4)
TOKENIZER_FROM = "qwen2.5-coder-1.5b"  # a packaged GGUF with the Qwen vocabulary


@dataclass(frozen=True)
class MoeShape:
    """The numbers of an MoE checkpoint's config.json that fix its tensors (`arch`: qwen3moe or
    gpt-oss, the GGUF architecture)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_size: int
    dense_size: int   # feed_forward_length (no dense layer uses it in Qwen3-MoE; written as the converter does)
    vocab: int = 151936
    context: int = 40960
    rope_theta: float = 1e6
    eps: float = 1e-6
    arch: str = "qwen3moe"


SHAPES = {"qwen3-30b-a3b": MoeShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                                    experts_used=8, expert_size=768, dense_size=6144),
          "gpt-oss-20b": MoeShape(layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, experts_used=4,
                                  expert_size=2880, dense_size=2880, vocab=201088, context=131072, rope_theta=150000.0,
                                  eps=1e-5, arch="gpt-oss")}
FILE_TYPES = {"qwen3moe": LlamaFileType.MOSTLY_Q4_K_M, "gpt-oss": LlamaFileType.MOSTLY_MXFP4_MOE}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v and ffn_down: Q6_K in the first and last eighth of the
    layers and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks for a weight of `shape` (rows of the last dimension): bytes [..., row_bytes]
    with every block's fp16 scale(s) set so the weights are ~1e-2 and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    if cols % block:
        raise QuickdraftError(f"rows of {cols} are not whole {qtype.name} blocks of {block}")
    blocks = rng.integers(0, 256, size=(*lead, cols // block, size), dtype=np.uint8)
    if qtype == Q4_K:  # d, dmin (fp16) first; weight = d * scale * q - dmin * min, scale and min 6 bits, q 4 bits:
        # dmin = 7.5 d centres the weights (mean q is 7.5, scales and mins alike), else every one leans positive
        blocks[..., 0:4] = np.array([2e-5, 1.5e-4], dtype=np.float16).view(np.uint8)
    elif qtype == Q6_K:  # d (fp16) last; weight = d * scale * (q - 32), scale int8, q 6 bits
        blocks[..., size - 2:] = np.array([5e-6], dtype=np.float16).view(np.uint8)
    elif qtype == Q8_0:  # d (fp16) first; weight = d * q, q int8
        blocks[..., 0:2] = np.array([1.5e-4], dtype=np.float16).view(np.uint8)
    elif qtype == MXFP4:  # E8M0 e first; weight = 2^(e - 128) * (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12)
        blocks[..., 0] = 120
    else:
        raise QuickdraftError(f"random blocks of {qtype.name} are not written")
    return blocks.reshape(*lead, cols // block * size)


def copy_tokenizer(writer: GGUFWriter, source: Path, vocab: int) -> None:
    """The tokenizer's keys of another GGUF, as stored, its vocabulary padded to `vocab` tokens with
    reserved (control) tokens."""
    reader = GGUFReader(source)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            values = field.contents()
            if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                pad = vocab - len(values)
                if pad < 0:
                    raise QuickdraftError(f"a vocabulary of {vocab} is smaller than {source.name}'s {len(values)}")
                values += [f"<|reserved_{i}|>" for i in range(pad)] if name.endswith("tokens") else [3] * pad
            writer.add_array(name, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)


Kind = GGMLQuantizationType | str  # a block type, "norm" (ones), "zeros" (F32: biases, sinks) or "router" (F32, random)


def tensor_specs(s: MoeShape) -> list[tuple[str, Kind, tuple[int, ...]]]:
    """(GGUF name, kind, element shape as numpy orders it) of every tensor, in file order."""
    if s.arch == "gpt-oss":
        return gpt_oss_specs(s)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    specs: list[tuple[str, Kind, tuple[int, ...]]] = [("token_embd.weight", Q4_K, (s.vocab, s.hidden))]
    for i in range(s.layers):
        more = Q6_K if more_bits(i, s.layers) else Q4_K
        specs += [(f"blk.{i}.attn_norm.weight", "norm", (s.hidden,)),
                  (f"blk.{i}.attn_q.weight", Q4_K, (q, s.hidden)),
                  (f"blk.{i}.attn_k.weight", Q4_K, (kv, s.hidden)),
                  (f"blk.{i}.attn_v.weight", more, (kv, s.hidden)),
                  (f"blk.{i}.attn_output.weight", Q4_K, (s.hidden, q)),
                  (f"blk.{i}.attn_q_norm.weight", "norm", (s.head_dim,)),
                  (f"blk.{i}.attn_k_norm.weight", "norm", (s.head_dim,)),
                  (f"blk.{i}.ffn_norm.weight", "norm", (s.hidden,)),
                  (f"blk.{i}.ffn_gate_inp.weight", "router", (s.experts, s.hidden)),
                  (f"blk.{i}.ffn_gate_exps.weight", Q4_K, (s.experts, s.expert_size, s.hidden)),
                  (f"blk.{i}.ffn_up_exps.weight", Q4_K, (s.experts, s.expert_size, s.hidden)),
                  (f"blk.{i}.ffn_down_exps.weight", more, (s.experts, s.hidden, s.expert_size))]
    return specs + [("output_norm.weight", "norm", (s.hidden,)), ("output.weight", Q6_K, (s.vocab, s.hidden))]


def gpt_oss_specs(s: MoeShape) -> list[tuple[str, Kind, tuple[int, ...]]]:
    """gpt-oss's tensors as its converter writes them (gpt_oss.py): biased attention with sinks, a
    biased router, gate and up apart, every expert matrix and bias stacked."""
    q, kv, e = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts
    specs: list[tuple[str, Kind, tuple[int, ...]]] = [("token_embd.weight", Q8_0, (s.vocab, s.hidden))]
    for i in range(s.layers):
        for name, rows, cols in (("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden),
                                 ("attn_output", s.hidden, q)):
            specs += [(f"blk.{i}.{name}.weight", Q8_0, (rows, cols)), (f"blk.{i}.{name}.bias", "zeros", (rows,))]
        specs += [(f"blk.{i}.attn_norm.weight", "norm", (s.hidden,)),
                  (f"blk.{i}.attn_sinks.weight", "zeros", (s.heads,)),
                  (f"blk.{i}.post_attention_norm.weight", "norm", (s.hidden,)),
                  (f"blk.{i}.ffn_gate_inp.weight", "router", (e, s.hidden)),
                  (f"blk.{i}.ffn_gate_inp.bias", "zeros", (e,))]
        for name, rows, cols in (("gate", s.expert_size, s.hidden), ("up", s.expert_size, s.hidden),
                                 ("down", s.hidden, s.expert_size)):
            specs += [(f"blk.{i}.ffn_{name}_exps.weight", MXFP4, (e, rows, cols)),
                      (f"blk.{i}.ffn_{name}_exps.bias", "zeros", (e, rows))]
    return specs + [("output_norm.weight", "norm", (s.hidden,)), ("output.weight", Q8_0, (s.vocab, s.hidden))]


def _metadata(writer: GGUFWriter, s: MoeShape) -> None:
    """The architecture's keys, as its converter writes them."""
    writer.add_name(f"random {s.arch}, {s.layers} layers")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.dense_size)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.experts_used)
    writer.add_expert_feed_forward_length(s.expert_size)
    if s.arch == "gpt-oss":  # every other layer sliding (128), YaRN 32x over 4,096 positions
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_file_type(FILE_TYPES[s.arch])


def write_random_moe(shape: MoeShape, path: Path, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Write `shape` as a random-weight GGUF of its architecture at `path`."""
    from quickdraft.weights.resolve import resolve_model
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), shape.arch)
    _metadata(writer, shape)
    copy_tokenizer(writer, resolve_model(TOKENIZER_FROM).path, shape.vocab)

    specs = tensor_specs(shape)
    # the header needs every tensor's shape and type before any data; then each is made, written, dropped
    for name, kind, dims in specs:
        if isinstance(kind, GGMLQuantizationType):
            block, size = GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[:-1]))
            writer.add_tensor_info(name, dims, np.dtype(np.float32), rows * dims[-1] // block * size, raw_dtype=kind)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for n, (_, kind, dims) in enumerate(specs):
        if kind == "norm":
            data = np.ones(dims, dtype=np.float32)
        elif kind == "zeros":
            data = np.zeros(dims, dtype=np.float32)
        elif kind == "router":
            data = rng.standard_normal(dims, dtype=np.float32) * 0.02
        else:
            data = random_blocks(kind, dims, rng)
        writer.write_tensor_data(data)
        if progress and (n % 24 == 0 or n == len(specs) - 1):
            progress(f"{n + 1}/{len(specs)} tensors written")
    writer.close()
    return path
