"""Where the engine's rows live: running rows in cache rows 0..n-1, the row whose prompt is being
prefilled in row n; the cache grown as they need, a prompt's cached prefix shared into its row, and
their K/V left to the prefix cache (a prompt's as it starts decoding, a row's as it ends) and
their blocks given back as rows are freed, the rows kept packed. Leaving K/V takes a row's full
blocks by reference and copies only a last partial block (kv/prefix_cache.py), so it is done whole
at once (a tenth of a decode step at 4,000 tokens: docs/notes/paged-kv.md). Knows rows and caches;
not the model or the step.
"""
from __future__ import annotations

import logging

import torch

from quickdraft.engine.rows import Row, features_of
from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache

log = logging.getLogger("quickdraft.engine")


class Placement:
    def __init__(self, cache: KVCache, prefix: PrefixCache | None, grows: bool, pad: int, max_batch: int,
                 max_seq_len: int) -> None:
        """grows: the cache is the engine's own, grown as requests need (`reserve`); pad: slots past
        a row's end its drafts may take."""
        self.cache, self.prefix = cache, prefix
        self.grows, self.pad, self.max_batch, self.max_seq_len = grows, pad, max_batch, max_seq_len
        self.rows: list[Row] = []       # row i lives in cache row i
        self.filling: Row | None = None  # the row whose prompt is being prefilled: cache row n

    def reserve(self, rows: int, length: int) -> None:
        """A cache of our own holds `rows` rows of `length` slots: its tables grown by doubling (an
        allocated pool, CUDA's, copies its used blocks then), never past max_batch rows of
        max_seq_len (+ pad) slots."""
        have = self.cache
        if not self.grows or (rows <= have.batch_size and length <= have.max_len):
            return
        rows = max(rows, 2 * have.batch_size) if rows > have.batch_size else rows
        length = max(length, 2 * have.max_len) if length > have.max_len else length
        have.reserve(min(rows, self.max_batch), min(length, self.max_seq_len + self.pad))

    def fetch(self, row: Row) -> torch.Tensor | None:
        """Cache row n (where `row` goes) given back, then holding the longest prefix of its prompt
        the prefix cache has (its last token is always fed: its logits give the first token); that
        prefix's features [m, F], None on a miss. A cache that fails (out of memory) is a miss."""
        n = len(self.rows)
        self.cache.release(n)
        if self.prefix is None:
            return None
        try:
            return self.prefix.fetch(row.tokens, len(row.tokens) - 1, self.cache, n, row.request.cache_scope)
        except Exception:  # noqa: BLE001 - the prompt is prefilled whole
            log.warning("the prefix cache failed to give a prompt's K/V; prefilling it whole", exc_info=True)
            return None

    def offer(self, row: Row, i: int, features: torch.Tensor) -> None:
        """Leave a row's K/V (cache row i) to the prefix cache, unless its pass failed: its tokens'
        with `features` [n, F]. A cache that fails (out of memory) loses only the caching, never
        the request or the engine."""
        if self.prefix is None or row.failed:
            return
        try:
            self.prefix.store(row.tokens, self.cache, i, features, scope=row.request.cache_scope)
        except Exception:  # noqa: BLE001
            log.warning("the prefix cache failed to keep a request's K/V; going on without", exc_info=True)

    def drop_filling(self) -> None:
        """The filling row is gone (its prompt failed, was only scored, or its request cancelled),
        or its admission failed: cache row n gives its blocks back now, not at the next admission
        (which may never land on n). (A cache that failed to grow has no row n.)"""
        self.filling = None
        if len(self.rows) < self.cache.batch_size:
            self.cache.release(len(self.rows))

    def leave(self, row: Row, i: int) -> None:
        """A row that ends (in cache row i) leaves its K/V to the prefix cache."""
        if self.prefix is not None and not row.failed:
            self.offer(row, i, features_of(row))

    def free(self, i: int) -> None:
        """Row i is gone: the last row moves into its cache row (whose blocks go back), or the freed
        row gives its blocks back; the filling row moves down behind the running ones."""
        last = len(self.rows) - 1
        if i != last:
            self.cache.move_row(last, i)
            self.rows[i] = self.rows[last]
        else:
            self.cache.release(i)
        self.rows.pop()
        if self.filling is not None:
            self.cache.move_row(last + 1, last)
        self.sync_lengths()

    def sync_lengths(self) -> None:
        """The cache's lengths are the rows' committed lengths (what a step appended past them goes)."""
        lengths = [row.length for row in self.rows] + ([self.filling.length] if self.filling else [])
        self.cache.truncate(lengths + [0] * (self.cache.batch_size - len(lengths)))
