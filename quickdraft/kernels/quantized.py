"""`QuantizedWeight`: a weight matrix kept in GGUF block formats, exactly as the file stores it.

Rows stay as the file's blocks (a memory map, no copy), so a pass reads 4.5-8.5 bits per weight
instead of 16 or 32; when the C kernel runs, each part is also repacked once, at construction
(the load), into the kernel's layout: the same numbers and bytes, rearranged (kernels/repack.h). Fused matrices (q|k|v, gate|up) are lists of parts, because a GGUF file may
store their pieces in different types (Q4_K_M keeps attn_v in Q6_K). Dequantization, where
anything needs float values (embedding rows, a draft head's vocabulary, the torch path), is
gguf's own.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from quickdraft.kernels.build import active_library

ACTIVATION_BITS = (16, 8)
# The block types the kernel multiplies as stored (quant_matmul.c); others are dequantized at load.
KERNEL_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.MXFP4,
})


@dataclass(frozen=True)
class Part:
    qtype: GGMLQuantizationType
    blocks: np.ndarray  # [rows, row_bytes] uint8: the file's blocks for these rows
    packed: np.ndarray | None = None  # [rows, packed row bytes] uint8: the kernel's layout, once repacked

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


def _repacked(part: Part, in_features: int) -> Part:
    """The part with its kernel layout, when the kernel runs and takes the type (else as it is)."""
    lib = active_library()
    if part.packed is not None or lib is None or part.qtype not in KERNEL_TYPES:
        return part
    packed = np.empty((part.rows, lib.qd_packed_row_bytes(int(part.qtype), in_features)), dtype=np.uint8)
    blocks = np.ascontiguousarray(part.blocks)
    status = lib.qd_repack(int(part.qtype), blocks.ctypes.data, part.rows, in_features, packed.ctypes.data,
                           torch.get_num_threads())
    assert status == 0, f"the kernel refused to repack {part.qtype.name} rows of {in_features}"
    return replace(part, packed=packed)


class QuantizedWeight:
    """An [N, K] weight as GGUF blocks, in one or more row ranges (parts). `activation_bits` (16 or
    8) is the precision the kernel rounds its input rows to (quant_matmul.c): int8 halves the
    multiplies per row of a multi-row pass, at a cost in agreement with float32 that depends on the
    model (`bench quality` measures it)."""

    def __init__(self, parts: list[Part], in_features: int, activation_bits: int = 16) -> None:
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, not {activation_bits}")
        for p in parts:
            block, size = GGML_QUANT_SIZES[p.qtype]
            if in_features % block or p.blocks.shape[1] != in_features // block * size or p.blocks.dtype != np.uint8:
                raise ValueError(f"{p.qtype.name} blocks of shape {p.blocks.shape} do not hold rows of "
                                 f"{in_features} weights")
        self.parts = [_repacked(p, in_features) for p in parts]
        self.in_features = in_features
        self.activation_bits = activation_bits

    @classmethod
    def cat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights with the same K, one after another (no copy)."""
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("cannot stack quantized weights with different input sizes")
        if len({w.activation_bits for w in weights}) != 1:
            raise ValueError("cannot stack quantized weights whose activations differ in precision")
        return cls([p for w in weights for p in w.parts], weights[0].in_features, weights[0].activation_bits)

    def with_activations(self, bits: int) -> QuantizedWeight:
        """The same blocks (no copy, no repack) with activations rounded to `bits`."""
        return self if bits == self.activation_bits else QuantizedWeight(self.parts, self.in_features, bits)

    @functools.cached_property
    def c_parts(self) -> tuple[int, ctypes.Array, ctypes.Array, ctypes.Array, int]:
        """(parts, types, rows, repacked block pointers, int8 activations) as the C kernel takes them, built once: a
        decode step calls the kernel ~100 times and building these per call cost ~10% of it on SmolLM2."""
        assert all(p.packed is not None for p in self.parts), "the kernel runs weights it has repacked"
        n = len(self.parts)
        return (n, (ctypes.c_int * n)(*(int(p.qtype) for p in self.parts)),
                (ctypes.c_int64 * n)(*(p.rows for p in self.parts)),
                (ctypes.c_void_p * n)(*(p.packed.ctypes.data for p in self.parts)), int(self.activation_bits == 8))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.rows for p in self.parts), self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its dequantized values."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.nbytes for p in self.parts)

    @property
    def types(self) -> str:
        return "+".join(sorted({p.qtype.name for p in self.parts}))

    def rows_of(self, index: torch.Tensor | list[int] | np.ndarray) -> torch.Tensor:
        """Dequantized float32 rows [len(index), K]."""
        idx = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
        out = np.empty((idx.size, self.in_features), dtype=np.float32)
        start = 0
        for p in self.parts:
            hit = (idx >= start) & (idx < start + p.rows)
            if hit.any():
                out[hit] = dequantize(p.blocks[idx[hit] - start], p.qtype).reshape(-1, self.in_features)
            start += p.rows
        if idx.size and (idx.min() < 0 or idx.max() >= start):
            raise IndexError(f"row index out of range for a weight of {start} rows")
        return torch.from_numpy(out)

    def take(self, index: torch.Tensor | list[int] | np.ndarray) -> QuantizedWeight:
        """The rows asked for, in that order, still as stored (a copy of their blocks)."""
        idx = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for a weight of {self.shape[0]} rows")
        parts, start = [], 0
        for p in self.parts:
            # a run of the index inside one part stays one part (the usual case: sorted rows)
            hit = np.flatnonzero((idx >= start) & (idx < start + p.rows))
            for run in np.split(hit, np.flatnonzero(np.diff(hit) != 1) + 1) if hit.size else []:
                parts.append((run[0], Part(p.qtype, np.ascontiguousarray(p.blocks[idx[run] - start]))))
            start += p.rows
        return QuantizedWeight([part for _, part in sorted(parts, key=lambda e: e[0])], self.in_features,
                               self.activation_bits)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 [N, K]."""
        return torch.cat([torch.from_numpy(dequantize(p.blocks, p.qtype).reshape(p.rows, self.in_features))
                          for p in self.parts])

    def __getitem__(self, index: object) -> torch.Tensor:
        """w[rows] or w[rows, cols]: dequantized values of the rows asked for."""
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if isinstance(rows, slice):
            rows = range(*rows.indices(self.shape[0]))
        elif isinstance(rows, int):
            return self.rows_of([rows])[0][rest] if rest else self.rows_of([rows])[0]
        values = self.rows_of(list(rows) if isinstance(rows, (range, tuple)) else rows)
        return values[(slice(None), *rest)] if rest else values

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.types}, shape={tuple(self.shape)}, activations=int{self.activation_bits})"
