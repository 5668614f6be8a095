"""A cache's K/V as the attention kernel reads them (kernels.h's QDPages): every row a table of
blocks in one pool per layer. Checked here once per forward, not asserted (python -O drops asserts):
the C code follows these numbers with raw pointers.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

# pools checked already (a model's pool views are made once): id of the K pool -> (weak references
# to it and its V pool, blocks, block); the checks cost ~9 us, 30 times a forward
_CHECKED: dict[int, tuple[weakref.ref, weakref.ref, int, int]] = {}


class _QDPages(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("width", ctypes.c_int64), ("shift", ctypes.c_int64), ("block_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64)]


class Pages:
    """tables [R, width] int32: cache row r's slots j lie in block tables[r, j // block] at offset
    j % block, of a layer's pools k, v [blocks, Hkv, block, hd]. `block` a power of two and a
    multiple of 8 (a group of 8 keys the kernel scores together lies in one block), or any length
    where every row is one block (width 1). A forward of kv_len slots checks its tables here once;
    each layer then only binds its pools (`bind`)."""

    def __init__(self, tables: torch.Tensor, block: int, blocks: int, kv_len: int) -> None:
        if tables.dtype != torch.int32 or tables.dim() != 2 or not tables.is_contiguous() or tables.device.type != "cpu":
            raise ValueError(f"block tables must be a contiguous 2-d int32 CPU tensor, found {tables.dtype} "
                             f"{tuple(tables.shape)}")
        R, width = tables.shape
        paged = block & (block - 1) == 0 and block % 8 == 0
        if width != 1 and not paged:
            raise ValueError(f"blocks of {block} slots: the kernel reads several per row only when a block is a "
                             "power of two and a multiple of 8")
        if kv_len > width * block:
            raise ValueError(f"{kv_len} slots do not fit in {width} blocks of {block}")
        if R and (int(tables.min()) < 0 or int(tables.max()) >= blocks):
            raise ValueError(f"a block table names a block outside the pool's 0..{blocks - 1}")
        self.tables, self.block, self.blocks = tables, block, blocks
        shift = block.bit_length() - 1 if paged and width != 1 else -1
        self.struct = _QDPages(None, None, tables.data_ptr(), width, shift, 0, 0)

    @staticmethod
    def rows(batch: int, length: int) -> "Pages":
        """Buffers [batch, Hkv, length, hd]: a pool whose block r is row r whole."""
        return Pages(torch.arange(batch, dtype=torch.int32)[:, None], length, batch, length)

    def bind(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """The address of the struct pointing at this layer's pools k, v [blocks, Hkv, block, hd]."""
        known = _CHECKED.get(id(k))
        if known is None or known[0]() is not k or known[1]() is not v or known[2:] != (self.blocks, self.block):
            self._check(k, v)
            if len(_CHECKED) > 4096:  # ids of pools long gone
                _CHECKED.clear()
            _CHECKED[id(k)] = (weakref.ref(k), weakref.ref(v), self.blocks, self.block)
        s = self.struct
        s.k, s.v, s.block_stride, s.head_stride = k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1)
        return ctypes.addressof(s)

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if not (k.shape == v.shape and k.stride() == v.stride() and k.shape[0] == self.blocks
                and k.shape[2] == self.block and k.stride()[2:] == (k.shape[3], 1) and k.dtype == torch.float32
                and v.dtype == torch.float32 and k.device.type == v.device.type == "cpu"):
            raise ValueError(f"K/V pools of shape {tuple(k.shape)} and strides {k.stride()}, {v.stride()} are not "
                             f"{self.blocks} float32 blocks of {self.block} slots as the kernel reads them")
