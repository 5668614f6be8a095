"""Reading a GGUF file's header: metadata and tensor locations, tensors as views of a memory map.

gguf's own GGUFReader builds a numpy view per metadata element, which takes ~6 s for a 150k-token
vocabulary; this reader parses numeric arrays with one `frombuffer` each and string arrays with
one tight loop, so a 1.5B model's header reads in well under a second. Knows the container format
only (GGUF v2/v3, little-endian), nothing of models.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> (struct code, numpy dtype) for the fixed-size ones
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
           4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
           10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the contiguous dimension first
    data: np.ndarray        # float32/float16 values, or uint8 blocks [..., row_bytes], in numpy order


class GGUFFile:
    """`fields`: every metadata key -> Python value (lists for arrays); `tensors`: in file order."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if self._read(4) != MAGIC:
            raise ValueError("missing the magic bytes 'GGUF'")
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError(f"the file ends inside its header (at byte {self._pos}, wanted {n} more)")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return bytes(out)

    def _scalar(self, vtype: int) -> Any:
        code, _ = SCALARS[vtype]
        return struct.unpack(code, self._read(struct.calcsize(code)))[0]

    def _string(self) -> str:
        return self._read(self._scalar(10)).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item in SCALARS:
                dtype = np.dtype(SCALARS[item][1]).newbyteorder("<")
                values = np.frombuffer(self._read(count * dtype.itemsize), dtype=dtype)
                return values.tolist()
            if item == STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        if vtype not in SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self._scalar(vtype)

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): ~0.3 us each, where one `_string`
        call per item took ~4 us (1.5 s of a 1.5B model's load)."""
        buf, pos, end_of_file = self._map, self._pos, len(self._buf)
        length = struct.Struct("<Q").unpack_from
        out: list[str] = []
        for _ in range(count):
            end = pos + 8 + length(buf, pos)[0] if pos + 8 <= end_of_file else end_of_file + 1
            if end > end_of_file:
                raise ValueError(f"the file ends inside its header (at byte {pos}, in an array of strings)")
            out.append(buf[pos + 8:end].decode("utf-8", errors="replace"))
            pos = end
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        qtype = GGMLQuantizationType(self._scalar(4))
        return name, dims, qtype, self._scalar(10)

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, at: int) -> TensorInfo:
        block, size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} values are not whole {qtype.name} blocks")
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        nbytes = rows * dims[0] // block * size
        if at + nbytes > len(self._buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=at)
        shape = tuple(reversed(dims))
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], dims[0] // block * size)
        return TensorInfo(name, qtype, dims, data)
