"""The engine's rows leaving: their K/V to the prefix cache (a prompt's as it starts decoding, a
row's as it ends), their proposer's state for them let go, and the cache rows kept packed as rows
are freed. Leaving K/V takes a row's full blocks by reference and copies only a last partial block
(kv/prefix_cache.py), so it is done whole at once: a 4,000-token row's 250 blocks took 8 ms
(SmolLM2, Intel Xeon, 2 cores), a tenth of a decode step at that context. A mixin of Engine
(engine/batch.py), whose state it reads and writes.
"""
from __future__ import annotations

import logging

import torch

from quickdraft.engine.rows import Row, features_of
from quickdraft.proposers.base import EACH

log = logging.getLogger("quickdraft.engine")


class Leaving:
    def _offer(self, row: Row, i: int, features: torch.Tensor) -> None:
        """Leave a row's K/V (cache row i) to the prefix cache, unless its pass failed: its tokens'
        with `features` [n, D]. A cache that fails (out of memory) loses only the caching, never
        the request or the engine."""
        if self.prefix is None or row.failed:
            return
        try:
            self.prefix.store(row.tokens, self.cache, i, features, scope=row.request.cache_scope)
        except Exception:  # noqa: BLE001
            log.warning("the prefix cache failed to keep a request's K/V; going on without", exc_info=True)

    def _leave(self, row: Row, i: int) -> None:
        """A row that ends (in cache row i) leaves its K/V to the prefix cache."""
        if self.prefix is not None and not row.failed:
            self._offer(row, i, features_of(row))

    def _free(self, i: int) -> None:
        """Keep running rows in cache rows 0..n-1 (and the filling row in row n): the last row moves
        into the freed one (its blocks given back), or the freed row gives its blocks back."""
        last = len(self.rows) - 1
        if i != last:
            self.cache.move_row(last, i)
            self.rows[i] = self.rows[last]
        else:
            self.cache.release(i)
        self.rows.pop()
        if self.filling is not None:
            self.cache.move_row(last + 1, last)
        self._sync_cache_lengths()

    def _release_proposer(self, row: Row) -> None:
        """The row's proposer group lets go of what it holds for it (a draft model's cache row) now;
        a group that fails to costs only that memory, until the proposer is garbage."""
        proposer = row.request.proposer
        if proposer is not None:
            try:
                (proposer.group or EACH).release([proposer])
            except Exception:  # noqa: BLE001
                log.warning("a proposer group failed to let go of an ended request's state", exc_info=True)

    def _sync_cache_lengths(self) -> None:
        lengths = [row.length for row in self.rows] + ([self.filling.length] if self.filling else [])
        self.cache.truncate(lengths + [0] * (self.cache.batch_size - len(lengths)))
