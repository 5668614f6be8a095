"""KV cache: rows of block tables over a pool of K/V blocks (blocks.py), and a committed length
per row.

The model writes K/V at the slots it is given; a forward first gets blocks for the slots it writes
(`slots`). Rollback of a chain is moving a row's length back: no copy; after a tree pass the kept
path is compacted into place (`compact`). This module does not know when or why rows are truncated
or compacted (the engine decides).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from quickdraft.errors import ContextTooLong
from quickdraft.kernels.pages import Pages
from quickdraft.kv.blocks import BLOCK, BlockPool, KVShape

__all__ = ["BLOCK", "BlockPool", "KVCache", "KVShape", "Slots"]


def width(max_len: int) -> int:
    """Blocks a row of max_len slots spans."""
    return -(-max_len // BLOCK)


def _tables(rows: int, max_len: int) -> torch.Tensor:
    with torch.inference_mode(False):  # a tensor of its own kind: a step (inference mode) may grow it
        return torch.zeros(rows, width(max_len), dtype=torch.int32)


@dataclass(frozen=True)
class Slots:
    """Where a forward's K/V go: slots [B, T] of the view's rows (a ragged pass: `rows` [T], each
    token's row, B = 1), their blocks allocated. `index` is the torch path's (block, offset) [B, T]."""
    slots: torch.Tensor
    tables: torch.Tensor

    @functools.cached_property  # once per forward, not once per layer
    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots.to(torch.int64)
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        return self.tables.to(slots.device, torch.int64)[rows, slots // BLOCK], slots % BLOCK


class KVCache:
    """Rows of block tables over a BlockPool: row r's slot j lies in block tables[r, j // BLOCK] at
    offset j % BLOCK (tables: host int32 [R, ceil(max_len / BLOCK)], 0 past a row's blocks); lengths:
    committed tokens per row (host ints). A row holds its blocks (one reference each) from the
    forward that first writes into them until `release` or `move_row` gives them back."""

    def __init__(self, config: KVShape | BlockPool, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Over the pool `config`, or a pool of its own for a model of that shape, with room for
        batch_size rows of max_len slots (blocks taken only as rows are written)."""
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"cache needs batch_size > 0 and max_len > 0, found {batch_size}, {max_len}")
        self.pool = config if isinstance(config, BlockPool) else BlockPool(config, dtype, device)
        self.pool.reserve(self.pool.used + batch_size * width(max_len))
        self.tables = _tables(batch_size, max_len)
        self.held = np.zeros(batch_size, np.int64)  # blocks each row holds: its table's first entries
        self.max_len = max_len
        self.lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def slots(self, slots: torch.Tensor, rows: torch.Tensor | None = None) -> Slots:
        """Blocks for every slot a forward writes: slots [B, T], of batch row b, or of row rows[t]
        (a ragged pass, B = 1); a row gets the blocks it lacks up to its largest slot. Raises
        ContextTooLong past max_len, and ValueError for a write into a block another holder shares
        (shared blocks are full and lie below every row's length: a write there is a bug that would
        change another row's tokens)."""
        s = slots.detach().to("cpu", torch.int64).numpy()
        if rows is None:
            owners, lo, hi = np.arange(s.shape[0]), s.min(1), s.max(1) + 1
        else:
            r = rows.detach().to("cpu", torch.int64).numpy()
            owners = np.unique(r)
            lo = np.array([s[0][r == o].min() for o in owners])
            hi = np.array([s[0][r == o].max() + 1 for o in owners])
        if hi.size and int(hi.max()) > self.max_len:
            raise ContextTooLong(
                f"position {int(hi.max()) - 1} is past the KV cache's capacity of {self.max_len} tokens")
        for row, first, end in zip(owners.tolist(), lo.tolist(), hi.tolist()):
            self._hold(row, end)
            if self.pool.shared(self.tables[row, first // BLOCK:width(end)].tolist()):
                raise ValueError(f"a forward would write slots {first}..{end - 1} of row {row}, in a block "
                                 "another row or the prefix cache shares")
        return Slots(slots, self.tables)

    def _hold(self, row: int, end: int) -> None:
        """Row `row` holds blocks for slots 0..end-1."""
        held = int(self.held[row])
        need = width(end) - held
        if need > 0:  # after the row's last block where those are free: the row stays one stretch
            ids = self.pool.alloc(need, after=int(self.tables[row, held - 1]) if held else None)
            self.tables[row, held:held + need] = torch.tensor(ids, dtype=torch.int32)
            self.held[row] += need

    def pages(self, kv_len: int) -> Pages:
        """The rows as the C kernel reads them, for a pass over kv_len slots (`pools` gives a
        layer's K/V)."""
        if kv_len > self.max_len:
            raise ContextTooLong(
                f"position {kv_len - 1} is past the KV cache's capacity of {self.max_len} tokens")
        return Pages(self.tables, BLOCK, self.pool.blocks, kv_len)

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V of every block: [NB, Hkv, BLOCK, hd] each (views)."""
        return self.pool.layers[layer]

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, hd] at `slots`; return the rows' first kv_len slots [B, Hkv, kv_len,
        hd] to attend over (the torch path: gathered from the blocks, a copy)."""
        block, offset = slots.index
        k_pool, v_pool = self.pools(layer)
        with torch.no_grad():  # the pool keeps values; gradients (a draft head's training) flow below
            k_pool[block, :, offset] = k.transpose(1, 2).to(k_pool.dtype)  # [B, T, Hkv, hd] at (block, offset)
            v_pool[block, :, offset] = v.transpose(1, 2).to(v_pool.dtype)
        ids = self.tables[:, :width(kv_len)].to(k_pool.device, torch.int64)  # [B, nb]
        keys, values = (pool[ids].transpose(1, 2).flatten(2, 3)[:, :, :kv_len] for pool in (k_pool, v_pool))
        if k.requires_grad or v.requires_grad:  # this pass's own K/V, with their gradients, at their slots
            at = (torch.arange(k.shape[0], device=k.device)[:, None], slots.slots.to(k.device, torch.int64))
            keys, values = (kept.transpose(1, 2).index_put(at, new.transpose(1, 2).to(kept.dtype)).transpose(1, 2)
                            for kept, new in ((keys, k), (values, v)))
        return keys, values

    def read(self, row: int, start: int, stop: int) -> torch.Tensor:
        """Slots start..stop-1 of `row`, every layer: [L, 2, Hkv, stop - start, hd] (a copy)."""
        ids = self.tables[row, :width(stop)].to(self.pool.kv.device, torch.int64)
        return self.pool.kv[:, :, :, ids].flatten(3, 4)[..., start:stop, :]

    def write_rows(self, row: int, start: int, kv: torch.Tensor) -> None:
        """kv [L, 2, Hkv, n, hd] into slots start..start+n-1 of `row` (a copy: the prefix cache's
        tests' and its foreign-pool path)."""
        n = kv.shape[3]
        if start + n > self.max_len:
            raise ContextTooLong(f"position {start + n - 1} is past the KV cache's capacity of {self.max_len} tokens")
        self._hold(row, start + n)
        slots = torch.arange(start, start + n)
        block = self.tables[row, slots // BLOCK].to(self.pool.kv.device, torch.int64)
        self.pool.kv[:, :, :, block, (slots % BLOCK).to(block.device)] = kv.to(self.pool.kv)

    def rows(self, start: int, stop: int) -> "KVCache":
        """Rows start..stop-1 as a cache of their own over the same pool and tables (blocks a forward
        takes for them are theirs here)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows {start}..{stop - 1} outside 0..{self.batch_size - 1}")
        view = object.__new__(KVCache)
        view.pool = self.pool
        view.tables = self.tables[start:stop]
        view.held = self.held[start:stop]
        view.max_len = self.max_len
        view.lengths = self.lengths[start:stop]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Row src's blocks and length become row dst's (whose own blocks are given back); src is
        left empty. No K/V moves (the engine keeps its running rows packed)."""
        self.release(dst)
        self.tables[dst], self.held[dst], self.lengths[dst] = self.tables[src], self.held[src], self.lengths[src]
        self.tables[src], self.held[src], self.lengths[src] = 0, 0, 0

    def share(self, row: int, ids: Sequence[int], part: tuple[int, int] | None = None) -> None:
        """Row `row` (its blocks given back first) holds blocks `ids` as its first slots, a
        reference each, then a copy of the first n slots of block `part` = (id, n) in a block of its
        own (a prefix's last, partly matched block: rows write past their length, never into a
        shared block)."""
        self.release(row)
        self.pool.incref(ids)
        self.tables[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.int32)
        self.held[row] = len(ids)
        if part is not None:
            self._hold(row, (len(ids) + 1) * BLOCK)
            self.pool.copy(part[0], int(self.tables[row, len(ids)]), part[1])

    def release(self, row: int) -> None:
        """Give back the row's blocks; it is empty."""
        self.pool.decref(self.tables[row, :self.held[row]].tolist())
        self.tables[row], self.held[row], self.lengths[row] = 0, 0, 0

    def release_all(self) -> None:
        for row in range(self.batch_size):
            self.release(row)

    def reserve(self, batch_size: int, max_len: int) -> None:
        """Room for at least batch_size rows of max_len slots (an engine grows its cache as requests
        need it, never shrinks it): larger tables, and the pool grown ahead so that a forward does
        not grow it. All or nothing: allocating may fail (out of memory)."""
        if batch_size <= self.batch_size and max_len <= self.max_len:
            return
        batch_size, max_len = max(batch_size, self.batch_size), max(max_len, self.max_len)
        self.pool.reserve(self.pool.used + batch_size * width(max_len) - int(self.held.sum()))
        tables = _tables(batch_size, max_len)
        tables[:self.batch_size, :self.tables.shape[1]] = self.tables
        self.tables, self.max_len = tables, max_len
        self.held = np.concatenate((self.held, np.zeros(batch_size - len(self.held), np.int64)))
        self.lengths = self.lengths + [0] * (batch_size - len(self.lengths))

    def compact(self, row: int, start: int, kept: Sequence[int]) -> None:
        """Move the K/V of slots `kept` (ascending, each >= its destination) of `row` to slots
        start, start+1, ...: a tree's accepted path into place. A chain's path is in place already.
        All of them lie past the row's committed tokens, in blocks of its own."""
        if list(kept) == list(range(start, start + len(kept))):
            return
        table = self.tables[row].to(torch.int64)
        src, dst = torch.tensor(kept), torch.arange(start, start + len(kept))
        kv = self.pool.kv
        device = kv.device
        kv[:, :, :, table[dst // BLOCK].to(device), (dst % BLOCK).to(device)] = \
            kv[:, :, :, table[src // BLOCK].to(device), (src % BLOCK).to(device)]  # the gather copies before the write

    def truncate(self, lengths: Sequence[int]) -> None:
        """Set every row's committed length (rollback of rejected tokens is a smaller number)."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"expected {self.batch_size} lengths, found {len(lengths)}")
        for n in lengths:
            if not 0 <= n <= self.max_len:
                raise ValueError(f"cache length {n} outside 0..{self.max_len}")
        self.lengths = list(lengths)
