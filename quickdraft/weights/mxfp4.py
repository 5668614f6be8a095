"""gpt-oss's published checkpoints (config.json `quantization_config.quant_method: mxfp4`): each
stacked expert matrix as two tensors, run as stored.

- `<name>_blocks` [E, rows, K/32, 16] uint8: 32 FP4 (E2M1) codes a block, two a byte, the even
  element in the low nibble; rows are the matrix's outputs (gate and up interleaved in gate|up's,
  as in the float checkpoints' columns);
- `<name>_scales` [E, rows, K/32] uint8: each block's E8M0 exponent (2 ** (s - 127)).

A GGUF MXFP4 block holds the same numbers in 17 bytes: the exponent byte, then 16 bytes whose low
nibbles are elements 0-15 and high nibbles 16-31 (its codes read twice the FP4 values, against a
scale of 2 ** (s - 128): the same products). So a block is repacked (nibbles moved, nothing
rounded), as llama.cpp's converter writes gpt-oss's GGUFs, and the kernel runs it as it runs theirs.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from quickdraft.errors import ModelLoadError
from quickdraft.kernels.quantized import Part, QuantizedWeight
from quickdraft.model.families import Family
from quickdraft.weights.names import expert_tensors, name_pattern

MXFP4 = GGMLQuantizationType.MXFP4


def unstack_blocks(tensors: dict[str, torch.Tensor], family: Family, as_stored: bool = True
                   ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every `<stacked matrix>_blocks` / `_scales` pair of `tensors` as each expert's gate, up and
    down weights under the family's per-expert names: MXFP4 blocks as stored, or (not `as_stored`:
    another device, --dequantize) their float32 values. The other tensors as they are (the stacked
    biases, for names.unstack_experts); the pairs are taken out of `tensors` as they go."""
    if family.stacked_experts is None:
        return tensors
    matrices = {0: name_pattern(family.stacked_experts[0]), 2: name_pattern(family.stacked_experts[2])}
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        which = next((k for k, pattern in matrices.items() if pattern.match(base)), None)
        if which is None:
            continue  # not an expert matrix: the model refuses the name
        blocks = ggml_blocks(name, tensors.pop(name), tensors.pop(base + "_scales", None))  # [E, rows, K/32 * 17]
        layer = matrices[which].match(base)["i"]
        pieces = {"expert_gate": blocks[:, 0::2], "expert_up": blocks[:, 1::2]} if which == 0 else {"expert_down": blocks}
        for role, stack in pieces.items():
            out |= expert_tensors(family, role, layer, [_weight(stack[e], as_stored) for e in range(stack.shape[0])])
    for name in tensors:  # every pair's scales are gone: these have no blocks
        if name.endswith("_scales") and any(p.match(name.removesuffix("_scales")) for p in matrices.values()):
            raise ModelLoadError(f"{name} has no {name.removesuffix('_scales')}_blocks beside it")
    return {**tensors, **out}


def ggml_blocks(name: str, blocks: torch.Tensor, scales: torch.Tensor | None) -> np.ndarray:
    """[E, rows, K/32, 16] codes and [E, rows, K/32] exponents -> [E, rows, K/32 * 17] GGUF MXFP4 blocks."""
    if scales is None:
        raise ModelLoadError(f"{name} has no {name.removesuffix('_blocks')}_scales beside it")
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ModelLoadError(f"{name} is {blocks.dtype} of shape {tuple(blocks.shape)}; expected uint8 "
                             f"[experts, rows, blocks, 16] (MXFP4: two 4-bit codes a byte)")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelLoadError(f"{name.removesuffix('_blocks')}_scales is {scales.dtype} of shape "
                             f"{tuple(scales.shape)}; expected uint8 {tuple(blocks.shape[:-1])} (a scale a block)")
    codes = blocks.numpy()
    values = np.empty(codes.shape[:-1] + (32,), dtype=np.uint8)  # one code a byte, in element order
    values[..., 0::2], values[..., 1::2] = codes & 0x0F, codes >> 4
    out = np.empty(codes.shape[:-1] + (17,), dtype=np.uint8)
    out[..., 0] = scales.numpy()
    out[..., 1:] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(*codes.shape[:2], -1)


def _weight(rows: np.ndarray, as_stored: bool) -> torch.Tensor | QuantizedWeight:
    """One expert's [rows, K/32 * 17] blocks as a weight [rows, K]."""
    rows, k = np.ascontiguousarray(rows), rows.shape[1] // 17 * 32
    if as_stored:
        return QuantizedWeight([Part(MXFP4, rows)], k)
    return torch.from_numpy(dequantize(rows, MXFP4).reshape(rows.shape[0], k))
