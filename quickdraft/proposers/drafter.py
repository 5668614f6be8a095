"""Batched drafting with one draft model: one KV cache with a row per live draft-model proposer,
and per draft step ONE forward for every row that drafts, whatever their lengths.

A Drafter is the proposer group (proposers/base.py) of every proposer drafting with its model; it
lives as long as the model (the target's shared state), not per request. It knows the draft model
and each member's committed tokens and cache row, nothing of the engine or the target.

A step's rows catch up on the tokens they have not run (one or two after a verification: the
last accepted draft and the target's token), right-aligned, so every row's newest token sits in
the forward's last column: a row with less to catch up runs a cached token again (at the cost of
the padding it replaces). A longer catch-up (the prompt) runs alone first. Rows of the cache span
that do not draft run a throwaway token past everything their owner still needs.
"""
from __future__ import annotations

import gc
import threading
import weakref
from collections import deque
from typing import Protocol, Sequence

import torch

from quickdraft.cache import KVCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import NO_DRAFT, Draft
from quickdraft.sampling import SamplingParams, probabilities, sample

CATCH_UP = 4  # tokens a row may catch up on inside the batched forward; more run alone first


class Member(Protocol):
    """What the drafter reads and keeps of a proposer drafting with it (draft_model.py)."""
    row: int | None           # its row of the drafter's cache (None: not drafted yet)
    tokens: list[int]         # the committed sequence
    cached: int               # tokens[:cached] have K/V in its row
    fed_drafts: int           # drafts of its last proposal whose K/V follow the cached ones
    capacity: int             # slots it may use
    params: SamplingParams
    generator: torch.Generator


class Drafter:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.taken: list[bool] = []          # per cache row: a live member owns it
        self.free_from: list[int] = []       # per cache row: the first slot its owner does not need
        self.released: deque[int] = deque()  # rows of members gone (appended from any thread)
        self.lock = threading.Lock()

    # -- members joining and leaving ----------------------------------------------------------------

    def _join(self, member: Member) -> None:
        """A cache row for a member drafting for the first time (not before: a waiting request
        holds none); it returns to the pool when the member is garbage."""
        if all(self.taken):  # a member in a reference cycle is freed only by the collector:
            gc.collect()     # cheaper than a cache row more, and every forward's span
            self._reclaim()
        row = self.taken.index(False) if False in self.taken else len(self.taken)
        rows = max(row + 1, len(self.taken))
        max_len = max(member.capacity + CATCH_UP, 0 if self.cache is None else self.cache.max_len)
        if self.cache is None or rows > self.cache.batch_size or max_len > self.cache.max_len:
            self._grow(rows, max_len)
        self.taken += [False] * (rows - len(self.taken))
        self.free_from += [0] * (rows - len(self.free_from))
        self.taken[row], self.free_from[row] = True, 0
        self.cache.lengths[row] = 0
        member.row = row
        weakref.finalize(member, self.released.append, row)

    def _reclaim(self) -> None:
        while self.released:
            row = self.released.popleft()
            self.taken[row], self.free_from[row] = False, 0
            self.cache.lengths[row] = 0

    def _grow(self, rows: int, max_len: int) -> None:
        """A larger cache holding what the old one held (members join rarely: a copy is cheap)."""
        new = self.model.new_cache(rows, max_len)
        if self.cache is not None:
            old = self.cache
            for a, b in zip(new.k + new.v, old.k + old.v):
                a[:old.batch_size, :, :old.max_len] = b
            new.lengths[:old.batch_size] = old.lengths
        self.cache = new

    def settle(self, member: Member) -> None:
        """The member committed a step: its row keeps K/V of tokens[:cached] and nothing more."""
        if member.row is None:
            return
        self.cache.lengths[member.row] = member.cached
        self.free_from[member.row] = member.cached

    def row_cache(self, member: Member) -> KVCache:
        """The member's row as a cache of its own (a view: tests read it); empty before its first draft."""
        if member.row is None:
            return self.model.new_cache(1, 1)
        return self.cache.rows(member.row, member.row + 1)

    # -- drafting -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, members: Sequence[Member], ks: Sequence[int]) -> list[Draft]:
        """A chain of up to ks[i] tokens for each member, drawn from its own q (the draft's
        distribution after the member's sampling settings) with its own generator. A failure
        leaves every member as it was (its generator rewound; K/V written past what it keeps)."""
        with self.lock:
            self._reclaim()
            for m in members:
                if m.row is None:
                    self._join(m)
            states = [m.generator.get_state() for m in members]
            try:
                return self._propose(members, ks)
            except Exception:
                for m, state in zip(members, states):
                    m.generator.set_state(state)
                raise

    def _propose(self, members: Sequence[Member], ks: Sequence[int]) -> list[Draft]:
        ks = [max(0, min(k, m.capacity - len(m.tokens) + 1)) for m, k in zip(members, ks)]
        going = [b for b, k in enumerate(ks) if k > 0]
        drafts = [NO_DRAFT] * len(members)
        if not going:
            return drafts
        for b in going:  # the prompt: alone, so the others are not padded to its length
            m = members[b]
            if len(m.tokens) - m.cached > CATCH_UP:
                self._forward([m], [m.tokens[m.cached:-1]], [m.cached])
                m.cached = len(m.tokens) - 1
                self.settle(m)
        width = max(len(members[b].tokens) - members[b].cached for b in going)
        starts = [max(0, len(members[b].tokens) - width) for b in going]
        logits = self._forward([members[b] for b in going],
                               [members[b].tokens[s:] for b, s in zip(going, starts)], starts)
        tokens: dict[int, list[int]] = {b: [] for b in going}
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in going}
        for i in range(max(ks)):
            for b, x in zip(going, self._draw(logits, [members[b] for b in going], [qs[b] for b in going])):
                tokens[b].append(x)
            going = [b for b in going if ks[b] > i + 1]
            if not going:
                break
            logits = self._forward([members[b] for b in going], [[tokens[b][-1]] for b in going],
                                   [len(members[b].tokens) + i for b in going])
        for b, drafted in tokens.items():
            m = members[b]
            m.cached, m.fed_drafts = len(m.tokens), len(drafted) - 1
            self.cache.lengths[m.row] = m.cached
            self.free_from[m.row] = m.cached + m.fed_drafts
            drafts[b] = Draft(drafted, None if m.params.greedy else torch.cat(qs[b]))
        return drafts

    @staticmethod
    def _draw(logits: torch.Tensor, members: Sequence[Member], qs: Sequence[list[torch.Tensor]]) -> list[int]:
        """logits [n, V] -> one token per member: the argmax for greedy members, else a draw from
        q = probabilities(logits) (the target's processing), appended to its qs."""
        best = logits.argmax(-1).tolist()  # one host sync for the greedy rows
        out = []
        for j, (m, q_list) in enumerate(zip(members, qs)):
            if m.params.greedy:
                out.append(best[j])
                continue
            q = probabilities(logits[j:j + 1], m.params)  # [1, V]
            q_list.append(q)
            out.append(int(sample(q, m.generator)))
        return out

    def _forward(self, members: Sequence[Member], feeds: Sequence[list[int]], starts: Sequence[int]) -> torch.Tensor:
        """Run each member's `feeds` tokens from slot `starts` on, all in one forward over the
        cache rows from the lowest member's to the highest's; -> logits [n, V] after each
        member's last fed token."""
        lo, hi = min(m.row for m in members), max(m.row for m in members) + 1
        span_feeds: list[list[int]] = [[0] for _ in range(lo, hi)]  # rows that do not draft: a throwaway
        span_starts = self.free_from[lo:hi]                           # token where nothing is kept
        for m, feed, start in zip(members, feeds, starts):
            span_feeds[m.row - lo], span_starts[m.row - lo] = feed, start
        width = max(map(len, feeds))
        device = self.model.device
        ids = torch.tensor([f + f[-1:] * (width - len(f)) for f in span_feeds], device=device)  # [S, width]
        positions = torch.tensor(span_starts, device=device)[:, None] + torch.arange(width, device=device)
        aligned = all(len(f) == width for f in feeds)
        out = self.model(ids, positions, self.cache.rows(lo, hi), last_n=1 if aligned else None)
        for m, feed, start in zip(members, feeds, starts):  # later forwards of this proposal keep off
            self.free_from[m.row] = max(self.free_from[m.row], start + len(feed))
        index = torch.tensor([m.row - lo for m in members], device=device)
        last = torch.tensor([-1 if aligned else len(f) - 1 for f in feeds], device=device)
        return out.logits[index, last]  # [n, V]
