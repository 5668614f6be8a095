"""K/V memory in fixed blocks: one pool of blocks of BLOCK tokens' K/V of every layer, handed out
by id with reference counts. A cache row is a table of block ids (cache.py); what moves between
rows, or to the prefix cache, is ids, not K/V.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import os
import platform
import sys
import threading
from typing import Iterable, Protocol

import numpy as np
import torch

BLOCK = 16  # tokens a block: a multiple of 8 (the kernel scores keys 8 at a time) and a power of two
ALIGN = 64  # bytes: a cache line, as torch's own allocator aligns
PAGE, HUGE_PAGE, MADV_NOHUGEPAGE = 4096, 2 << 20, 15  # Linux's (asm-generic/mman-common.h)
# Linux's on x86-64 and arm64 (Python 3.11's mmap module lacks it; other architectures number it otherwise)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
RESERVING_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")
MAX_RESERVED_BLOCKS = 1 << 20  # a reservation holds at most this many blocks (16M tokens), at most the machine's memory


class KVShape(Protocol):
    """What K/V memory needs to know of a model (a model's ModelConfig is one): the model imports
    this package, not the other way round."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # the last layer's output: the features kept beside the K/V by default (prefix_cache.py)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU from calloc, whose large blocks are pages the kernel zeroes when
    first written: a grown pool costs the copy of its used blocks, not a pass over every slot (zeroing
    a 1.5B's 4,000-token rows, ~470 MB, stalled every running row ~3 decode steps at admission)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    memory = np.zeros(size + ALIGN, np.uint8)  # calloc aligns to 16 bytes: the kernels' rows start on a cache line
    _no_huge_pages(memory)
    start = -memory.ctypes.data % ALIGN
    return torch.from_numpy(memory[start:start + size]).view(dtype).view(shape)


def reservation(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Zeros of `shape` in address space alone: an anonymous mapping that Linux backs with memory
    page by page as it is first written (MAP_NORESERVE: no commit charge for the rest), in 4 KB pages
    (see _no_huge_pages). A pool made of one grows by handing out higher ids, no copy ever. None where
    none is to be had (not Linux; strict overcommit, vm.overcommit_memory = 2, refuses the mapping)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in RESERVING_MACHINES:
        return None
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    try:
        memory.madvise(MADV_NOHUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages anyway
        pass
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping


def physical_memory() -> int:
    """Bytes of memory the machine has (a reservation past it could never be written)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _no_huge_pages(memory: np.ndarray) -> None:
    """Ask Linux for 4 KB pages here. A block's stripe of one layer and head is a few KB; with
    transparent huge pages the first token written into a fresh stretch made the kernel zero 2 MB (a
    new row's first prompt chunk: 112 such pages on the 1.5B, 40-190 ms, every other row stalled). In
    4 KB pages memory is zeroed as tokens arrive. A hint: where it is not taken, nothing else changes."""
    if not sys.platform.startswith("linux") or memory.nbytes < HUGE_PAGE:
        return
    start = memory.ctypes.data - memory.ctypes.data % PAGE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(memory.ctypes.data + memory.nbytes - start),
                    MADV_NOHUGEPAGE)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class BlockPool:
    """kv [L, 2, Hkv, NB, BLOCK, hd]: layer l's K of block b is kv[l, 0, :, b], its V kv[l, 1, :, b].
    Heads before blocks: one head's stripes of blocks with consecutive ids (a row's, as they are
    handed out) are one stretch of memory, read in order as a row's keys were before blocks (with
    blocks first, each 4 KB stripe lay a few pages past the last: ~20% slower attention at 3,000
    tokens of context, the prefetchers lost). Block 0 is the null block: never handed out, never
    written; tables name it past a row's blocks, so whatever the kernels read there stays inside the
    pool (such keys are masked). refs[b]: the holders of block b (rows, prefix-cache nodes); 0 = free.
    Thread-safe: one lock inside each call.

    On the CPU the pool is a reservation (`reservation`) of as many blocks as the machine's memory
    could hold: growing is handing out the next id, its pages written as tokens arrive, and no block
    is ever copied. Elsewhere (CUDA, or no reservation to be had) it is allocated and grows by
    doubling, the used blocks copied once a doubling."""

    def __init__(self, config: KVShape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 blocks: int = 0) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        kv = self._reservation(blocks + 1) if self.device.type == "cpu" else None
        self.reserved = kv is not None  # room for every block already: nothing is ever copied
        self._set(kv if kv is not None else self._allocated(blocks + 1))
        self.refs = np.zeros(blocks + 1, np.int32)  # ids < high are held or free; refs grows with high
        self.refs[0] = 1  # the null block, pinned
        self.free: list[int] = []  # ids given back, ascending (their pages written: reused before fresh ids)
        self.high = 1  # ids from here on were never handed out
        self.lock = threading.Lock()

    def _shape(self, blocks: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, c.num_kv_heads, blocks, BLOCK, c.head_dim)

    def _reservation(self, at_least: int) -> torch.Tensor | None:
        blocks = max(at_least, min(MAX_RESERVED_BLOCKS, physical_memory() // self.block_bytes))
        with torch.inference_mode(False):  # a tensor of its own kind: a step (inference mode) may write it
            return reservation(self._shape(blocks), self.dtype)

    def _allocated(self, blocks: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return zeros(self._shape(blocks), self.dtype, self.device)

    def _set(self, kv: torch.Tensor) -> None:
        self.kv = kv
        # per layer its K and V of every block as the kernels take them, [NB, Hkv, BLOCK, hd] views:
        # made once, not per layer per forward (~20 us each, 3% of a SmolLM2 decode step)
        self.layers = [(kv[layer, 0].transpose(0, 1), kv[layer, 1].transpose(0, 1)) for layer in range(kv.shape[0])]

    @property
    def blocks(self) -> int:
        """Ids 0..blocks-1 exist (the null block included): allocated, or reserved."""
        return self.kv.shape[3]

    @property
    def in_memory(self) -> int:
        """Blocks besides the null one that take memory: of a reservation, those ever handed out
        (a freed block keeps its pages, and is reused first); else every allocated one."""
        return (self.high if self.reserved else self.blocks) - 1

    @property
    def used(self) -> int:
        """Blocks some row or prefix-cache node holds."""
        with self.lock:
            return int(np.count_nonzero(self.refs)) - 1

    @property
    def block_bytes(self) -> int:
        c = self.config
        return c.num_layers * 2 * c.num_kv_heads * BLOCK * c.head_dim * self.dtype.itemsize

    def reserve(self, blocks: int) -> None:
        """Room for `blocks` blocks besides the null one: nothing to do in a reservation; else by
        doubling, the used ones copied once (all or nothing: allocating may fail, out of memory),
        never again once the pool is warm."""
        with self.lock:
            self._reserve(blocks + 1)

    def _reserve(self, blocks: int) -> None:
        if blocks <= self.blocks:
            return
        # past a reservation too (the machine's memory, or 2^20 blocks): double what is used, not it
        grown = self._allocated(max(blocks, 2 * (self.high if self.reserved else self.blocks)))
        grown[:, :, :, :self.high] = self.kv[:, :, :, :self.high]
        self._set(grown)
        self.reserved = False

    def alloc(self, n: int, after: int | None = None) -> list[int]:
        """n free blocks, each held once by the caller, ascending. The kernels read a row whose
        blocks are consecutive ids as one stretch and any other through its table, ~5-10% slower
        attention (attention.c's span_slots), so the ids are chosen to keep a row consecutive: those
        right after `after` (the row's last block) where they are free, else the first run of n
        free ids, else the lowest free ones (handing the most recent back first made every row after
        the first a broken stretch: a cold prompt's prefill 7% slower in a server); fresh ids (their
        pages unwritten, the memory grows) only past the free ones."""
        with self.lock:
            fresh = n - min(n, len(self.free))
            self._reserve(self.high + fresh)  # first: growing may fail (out of memory) with nothing taken
            reused = self._reused(n - fresh, after)
            if self.high + fresh > len(self.refs):
                grown = max(self.high + fresh, 2 * len(self.refs))
                self.refs = np.concatenate((self.refs, np.zeros(grown - len(self.refs), np.int32)))
            ids = reused + list(range(self.high, self.high + fresh))
            self.high += fresh
            self.refs[ids] = 1
            return ids

    def _reused(self, n: int, after: int | None) -> list[int]:
        """n of the free ids, taken from the free list (alloc's docstring says which)."""
        free = self.free
        if n == 0:
            return []
        start = bisect.bisect_left(free, after + 1) if after is not None else len(free)
        if not (start + n <= len(free) and free[start + n - 1] == after + n):  # not the n ids after `after`
            start = next((i for i in range(len(free) - n + 1) if free[i + n - 1] - free[i] == n - 1), 0)
        taken = free[start:start + n]
        del free[start:start + n]
        return taken

    def incref(self, ids: Iterable[int]) -> None:
        with self.lock:
            for i in ids:
                if not 0 < i < self.high or self.refs[i] <= 0:
                    raise ValueError(f"block {i} is not held: it cannot be shared")
                self.refs[i] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """Each id held once less; a block no one holds any more is free."""
        with self.lock:
            for i in ids:
                if not 0 < i < self.high or self.refs[i] <= 0:
                    raise ValueError(f"block {i} is not held: it cannot be given back")
                self.refs[i] -= 1
                if self.refs[i] == 0:
                    bisect.insort(self.free, i)

    def shared(self, ids: Iterable[int]) -> bool:
        """Whether any of the blocks has another holder (such a block is full and never written)."""
        return any(self.refs[i] > 1 for i in ids)

    def copy(self, src: int, dst: int, n: int = BLOCK) -> None:
        """The first n slots of block src into block dst, every layer: one op."""
        self.kv[:, :, :, dst, :n] = self.kv[:, :, :, src, :n]
