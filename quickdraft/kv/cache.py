"""KV cache: preallocated K/V buffers and a committed length per batch row.

The model writes K/V at the slots it is given. Rollback of a chain is moving a row's length back:
no copy; after a tree pass the kept path is compacted into place (`compact`). This module does not
know when or why rows are truncated or compacted (the engine decides).
"""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Protocol, Sequence

import numpy as np
import torch

from quickdraft.errors import ContextTooLong
from quickdraft.kernels.pages import Pages

# Where a forward's K/V go: positions [T] of a single row, or an index_put_ index for a batch.
Slots = torch.Tensor | tuple[torch.Tensor, ...]
ALIGN = 64  # bytes: a cache line, as torch's own allocator aligns
PAGE, HUGE_PAGE, MADV_NOHUGEPAGE = 4096, 2 << 20, 15  # Linux's (asm-generic/mman-common.h)


class KVShape(Protocol):
    """What K/V memory needs to know of a model (a model's ModelConfig is one): the model imports
    this module, not the other way round."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # the last layer's output kept beside the K/V (prefix_cache.py's features)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU from calloc, whose large blocks are pages the kernel zeroes when
    first written: a grown cache costs its rows' copies, not a pass over every slot (zeroing a 1.5B's
    4,000-token rows, ~470 MB, stalled every running row ~3 decode steps at admission)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    memory = np.zeros(size + ALIGN, np.uint8)  # calloc aligns to 16 bytes: the kernels' rows start on a cache line
    _no_huge_pages(memory)
    start = -memory.ctypes.data % ALIGN
    return torch.from_numpy(memory[start:start + size]).view(dtype).view(shape)


def _no_huge_pages(memory: np.ndarray) -> None:
    """Ask Linux for 4 KB pages here. A cache row's slots of one layer and head are one stretch of up
    to a few MB; with transparent huge pages the first token written into each made the kernel zero
    2 MB (a new row's first prompt chunk: 112 such pages on the 1.5B, 40-190 ms, every other row
    stalled). In 4 KB pages a row's memory is zeroed as its tokens arrive. A hint: where it is not
    taken, nothing else changes."""
    if not sys.platform.startswith("linux") or memory.nbytes < HUGE_PAGE:
        return
    start = memory.ctypes.data - memory.ctypes.data % PAGE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(memory.ctypes.data + memory.nbytes - start),
                    MADV_NOHUGEPAGE)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class KVCache:
    """k[layer], v[layer]: [B, Hkv, max_len, hd]; lengths: committed tokens per row (host ints)."""

    def __init__(self, config: KVShape, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"cache needs batch_size > 0 and max_len > 0, found {batch_size}, {max_len}")
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = [zeros(shape, dtype, torch.device(device)) for _ in range(config.num_layers)]
        self.v = [zeros(shape, dtype, torch.device(device)) for _ in range(config.num_layers)]
        self.max_len = max_len
        self.lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def slots(self, slots: torch.Tensor) -> Slots:
        """Index for `write` from slots [B, T], built once per forward."""
        if slots.shape[0] == 1:
            return slots[0]  # index_copy_ along the sequence axis: cheaper than index_put_
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None, None]
        heads = torch.arange(self.k[0].shape[1], device=slots.device)[None, :, None]
        return rows, heads, slots[:, None, :]

    def buffers(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's whole K and V buffers [B, Hkv, max_len, hd], for a pass attending over kv_len slots."""
        self._check(kv_len)
        return self.k[layer], self.v[layer]

    def pages(self, kv_len: int) -> Pages:
        """The rows as the C kernel reads them, for a pass over kv_len slots (`buffers` its pools)."""
        self._check(kv_len)
        return Pages.rows(self.batch_size, self.max_len)

    def _check(self, kv_len: int) -> None:
        if kv_len > self.max_len:
            raise ContextTooLong(
                f"position {kv_len - 1} is past the KV cache's capacity of {self.max_len} tokens")

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, hd] at `slots`; return the first kv_len slots to attend over."""
        k_buf, v_buf = self.buffers(layer, kv_len)
        if isinstance(slots, torch.Tensor):
            k_buf.index_copy_(2, slots, k)
            v_buf.index_copy_(2, slots, v)
        else:
            k_buf.index_put_(slots, k)
            v_buf.index_put_(slots, v)
        return k_buf[:, :, :kv_len], v_buf[:, :, :kv_len]

    def rows(self, start: int, stop: int) -> "KVCache":
        """Rows start..stop-1 as a cache of their own that shares these buffers (writes land here)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows {start}..{stop - 1} outside 0..{self.batch_size - 1}")
        view = object.__new__(KVCache)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.max_len = self.max_len
        view.lengths = self.lengths[start:stop]
        return view

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` slots of row src into row dst (the engine keeps rows packed)."""
        for buffers in (self.k, self.v):
            for t in buffers:
                t[dst, :, :length] = t[src, :, :length]
        self.lengths[dst] = length

    def reserve(self, batch_size: int, max_len: int) -> None:
        """Room for at least batch_size rows of max_len slots: new buffers (an engine grows its cache
        as requests need it, never shrinks it), each row's committed slots (`lengths`) copied over:
        what lies past them is rewritten before it is read, and copying only those keeps a growth
        from stalling the running rows for a copy of every slot the cache ever held."""
        if batch_size <= self.batch_size and max_len <= self.max_len:
            return
        batch_size, max_len = max(batch_size, self.batch_size), max(max_len, self.max_len)
        grown = {}
        with torch.inference_mode(False):  # buffers of their own kind: a step (inference mode) may grow them
            for name in ("k", "v"):
                grown[name] = [zeros((batch_size, old.shape[1], max_len, old.shape[3]), old.dtype, old.device)
                               for old in getattr(self, name)]
                for new, old in zip(grown[name], getattr(self, name)):
                    for row, length in enumerate(self.lengths):
                        new[row, :, :length] = old[row, :, :length]
        self.k[:], self.v[:] = grown["k"], grown["v"]  # all or nothing: allocating may fail (out of memory)
        self.max_len = max_len
        self.lengths = self.lengths + [0] * (batch_size - len(self.lengths))

    def compact(self, row: int, start: int, kept: Sequence[int]) -> None:
        """Move the K/V of slots `kept` (ascending, each >= its destination) of `row` to slots
        start, start+1, ...: a tree's accepted path into place. A chain's path is in place already."""
        if list(kept) == list(range(start, start + len(kept))):
            return
        index = torch.tensor(kept, device=self.k[0].device)
        for t in self.k + self.v:
            t[row, :, start:start + len(kept)] = t[row, :, index]  # the gather copies before the write

    def truncate(self, lengths: Sequence[int]) -> None:
        """Set every row's committed length (rollback of rejected tokens is a smaller number)."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"expected {self.batch_size} lengths, found {len(lengths)}")
        for n in lengths:
            if not 0 <= n <= self.max_len:
                raise ValueError(f"cache length {n} outside 0..{self.max_len}")
        self.lengths = list(lengths)
