"""The engine's rows leaving their K/V to the prefix cache, and freed rows leaving the cache rows
packed: a decoding row's prompt OFFER_BLOCKS blocks a step, an ended row's the same from the step
after it ended. A mixin of Engine (engine/batch.py), whose state it reads and writes.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from quickdraft.engine.rows import Row, features_of
from quickdraft.kv.prefix_cache import BLOCK
from quickdraft.proposers.base import EACH

OFFER_BLOCKS = 16  # prefix-cache blocks a prompt's K/V are copied in per step (256 tokens: a few ms)
log = logging.getLogger("quickdraft.engine")


class Leaving:
    def leaving(self) -> bool:
        """An ended row's K/V are still on their way to the prefix cache: steps take them in, a few
        blocks each, requests or none (or the next admission, all at once)."""
        return self.ended is not None or any(row.leaving for row in self.finished)

    def _offer(self, row: Row, i: int, features: torch.Tensor, max_blocks: int | None = None) -> bool:
        """Leave a row's K/V (cache row i) to the prefix cache, unless its pass failed: its tokens'
        with `features` [n, D]; at most `max_blocks` new blocks now (whether all are in). A cache
        that fails (out of memory) loses only the caching, never the request or the engine."""
        if self.prefix is None or row.failed:
            return True
        try:
            return self.prefix.store(row.tokens, self.cache, i, features, max_blocks, row.request.cache_scope)
        except Exception:  # noqa: BLE001
            log.warning("the prefix cache failed to keep a request's K/V; going on without", exc_info=True)
            return True

    def _offer_prompt(self, row: Row) -> None:
        """A row whose prompt is in leaves it to the prefix cache OFFER_BLOCKS blocks a step from the
        next step (`offering`): the step that ends a prompt has its last chunk and first token to
        pay for already (with its first blocks too, a 4,000-token prompt's last step stalled the
        other rows 3x). A prompt admitted meanwhile that starts the same way gets it whole first."""
        if self.prefix is not None and not row.failed:
            self.offering.append(row)

    def _offer_prompts(self, admitting: Sequence[int] | None = None) -> None:
        """Go on leaving the prompts of rows that started decoding to the prefix cache, OFFER_BLOCKS
        blocks a step each: a long prompt's K/V copied at once stalled every row (4,000 tokens of
        the 1.5B: 254 MB, 6x a decode step). `admitting`: a prompt about to look its prefix up;
        the rows whose prompts start as it does are left whole now (n choices of one request, or
        sessions behind one system prompt, would otherwise prefill again what is not in yet)."""
        for row in list(self.offering):
            shares = admitting is not None and row.tokens[:BLOCK] == list(admitting[:BLOCK])
            if admitting is not None and not shares:
                continue
            if row not in self.rows or row in self.finished or self._offer(
                    row, self.rows.index(row), row.features[0], None if shares else OFFER_BLOCKS):
                self.offering.remove(row)  # offered whole, or gone (an ending row leaves all it holds)

    def _leave(self, row: Row, i: int, whole: bool = False) -> None:
        """A row that ends (in cache row i) leaves its K/V to the prefix cache: OFFER_BLOCKS blocks
        a step from the next (`ended`: its step has a prompt's offer already, maybe its own) or, where
        rows must move first, all at its _free; `whole`: all now. Leaving a 4,000-token row's K/V at
        once (254 MB of the 1.5B's) stalled every other row ~5 decode steps."""
        if self.prefix is not None and not row.failed:
            row.leaving = not whole or not self._offer(row, i, features_of(row))

    def _offer_ended(self, whole: bool = False) -> None:
        """Go on leaving the ended row's K/V (cache row n) to the prefix cache; `whole`: all that is
        left, now (a prompt is about to be admitted into that row, or rows to move)."""
        row = self.ended
        if row is not None and self._offer(row, len(self.rows), features_of(row), None if whole else OFFER_BLOCKS):
            self.ended = None

    def _free(self, i: int) -> None:
        """Keep running rows in cache rows 0..n-1 (and the filling row in row n): the last row moves
        into the freed one. A freed row still leaving its K/V stays where it is (the `ended` row)
        if it was the last and no prompt is being filled, else leaves them all now."""
        self._offer_ended(whole=True)
        last, row = len(self.rows) - 1, self.rows[i]
        if row.leaving and (i != last or self.filling is not None):
            self._leave(row, i, whole=True)
        if i != last:
            self.cache.move_row(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        if self.filling is not None:
            self.cache.move_row(last + 1, last)
        self._sync_cache_lengths()
        if row.leaving:
            self.ended = row

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
