"""`quickdraft bench random-gguf`: a GGUF of a real model's shape with random weights, written as
Q4_K_M stores them, to measure speed against llama.cpp on models whose weights we cannot download
(Qwen3-30B-A3B: 17 GB as Q4_K_M).

The blocks are written directly: random quants with block scales chosen so each weight is ~1e-2,
no float copy of the model exists at any point, and the file is written tensor by tensor. Types
follow llama.cpp's Q4_K_M rule: Q4_K everywhere, Q6_K for the output, and for attn_v and the (expert)
down projections of the layers `more_bits` picks; norms and routers F32. The tokenizer is the
packaged Qwen2.5-Coder-1.5B's (the Qwen3 vocabulary: 151,936 tokens), so both engines load it
as any GGUF. Speed does not depend on the values; only their finiteness matters.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from quickdraft.errors import QuickdraftError

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
TOKENIZER_FROM = "qwen2.5-coder-1.5b"  # a packaged GGUF with the Qwen vocabulary


@dataclass(frozen=True)
class MoeShape:
    """The numbers of a Qwen3-MoE checkpoint's config.json that fix its tensors."""
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


SHAPES = {"qwen3-30b-a3b": MoeShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                                    experts_used=8, expert_size=768, dense_size=6144)}


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
    else:
        raise QuickdraftError(f"random blocks of {qtype.name} are not written")
    return blocks.reshape(*lead, cols // block * size)


def copy_tokenizer(writer: GGUFWriter, source: Path) -> None:
    """The tokenizer's keys of another GGUF, as stored."""
    reader = GGUFReader(source)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)


Kind = GGMLQuantizationType | str  # a block type, "norm" (ones) or "router" (F32, random)


def tensor_specs(s: MoeShape) -> list[tuple[str, Kind, tuple[int, ...]]]:
    """(GGUF name, kind, element shape as numpy orders it) of every tensor, in file order."""
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


def write_random_moe(shape: MoeShape, path: Path, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Write `shape` as a random-weight Q4_K_M GGUF (architecture qwen3moe) at `path`."""
    from quickdraft.weights.resolve import resolve_model
    rng = np.random.default_rng(seed)
    s = shape
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_name(f"random qwen3moe, {s.layers} layers")
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
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(writer, resolve_model(TOKENIZER_FROM).path)

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
        elif kind == "router":
            data = rng.standard_normal(dims, dtype=np.float32) * 0.02
        else:
            data = random_blocks(kind, dims, rng)
        writer.write_tensor_data(data)
        if progress and (n % 24 == 0 or n == len(specs) - 1):
            progress(f"{n + 1}/{len(specs)} tensors written")
    writer.close()
    return path
