"""The drafter's row pool: one KV cache with a row per live draft-model proposer (a member), rows
handed out on a member's first draft and taken back when it is released (ProposerGroup.release:
the engine releases a request's proposer when the request ends, is cancelled or fails, and every
one it holds when it is closed; a member drafting outside an engine is released by its user), and
the drafter's own state of each member (DraftRow: its row, what the row holds, its last draft).
Nothing waits for the garbage collector: a member's row lives exactly until its release.

Knows the cache, the members' committed tokens and the draft's prefix cache (a gone member's K/V
are offered to it before its row is reused); nothing of drafting, costs or the engine.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.draft_cost import CATCH_UP
from quickdraft.spec.draft_contract import Committed, PassCost
from quickdraft.spec.goodput import Acceptance
from quickdraft.spec.sampling import SamplingParams


class Member(Protocol):
    """What the drafter reads of a proposer drafting with it (draft_model.py): its request's own."""
    tokens: list[int]         # the committed sequence
    prompt_len: int           # tokens[prompt_len:] were generated (what penalties count)
    scope: str                # its request's prefix-cache scope (prefix_cache.py)
    width: int                # 1: it drafts chains; more: trees, running this many nodes per level
    capacity: int             # slots it may use
    horizon: int              # the sequence length at which its request ends at the latest
    params: SamplingParams
    generator: torch.Generator
    cost: PassCost | None     # what verification costs in the next step (None: draft ks whole)

    def took(self, step: Committed) -> None:
        """Its request's own part of a commit (the drafter kept the K/V): the tokens, the cost."""


@dataclass(eq=False)
class DraftRow:
    """The drafter's own state of a member: its cache row and its last draft, made on the member's
    first draft; the member never sees it."""
    row: int                  # its row of the drafter's cache
    cached: int = 0           # the member's tokens[:cached] have K/V in the row
    idle: int = 0             # proposals in a row it drafted nothing for
    offered: list[int] = field(default_factory=list)        # its last draft's tokens (a tree's: its likeliest path)
    confidences: list[float] = field(default_factory=list)  # the draft's probability of each of them
    nodes: list[tuple[int, int, int | None]] = field(default_factory=list)  # its last draft's nodes: token,
                                              # parent (-1: the root), the cache slot of its K/V (None: not run)
    record: Acceptance = field(default_factory=lambda: Acceptance(0.0, 0.0))  # its own drafts' verdicts
                                              # (draft_cost.expected), no pseudo-counts

    def run_path(self, accepted: Sequence[int]) -> list[int]:
        """The cache slots of the accepted draft nodes that were run, root first (the last node of
        a chain, and a tree's unexpanded leaves, were not: the path's K/V end there)."""
        run, parent = [], -1
        for token in accepted:
            parent = next((n for n, (t, p, _) in enumerate(self.nodes) if p == parent and t == token), None)
            if parent is None or self.nodes[parent][2] is None:
                break
            run.append(self.nodes[parent][2])
        return run


class RowPool:
    def __init__(self, model: Transformer, prefix: PrefixCache | None) -> None:
        self.model, self.prefix = model, prefix
        self.cache: KVCache | None = None
        self.taken: list[bool] = []          # per cache row: a live member owns it
        self.owners: list[list[int]] = []    # per cache row: its member's committed tokens (the member's
                                             # own list, read for the prefix cache once the member is gone)
        self.scopes: list[str] = []          # per cache row: its member's prefix-cache scope
        self.free_from: list[int] = []       # per cache row: the first slot its owner does not need
        self.released: deque[int] = deque()  # rows of members released, freed at the next reclaim
        self.members: dict[Member, DraftRow] = {}  # per member that drafted and is not released: its state
        self.longest, self.slack = 0, CATCH_UP  # the cache's length: the largest capacity + the widest forward

    def of(self, member: Member) -> DraftRow | None:
        """The member's state (None: it has not drafted yet)."""
        return self.members.get(member)

    def join(self, member: Member) -> DraftRow:
        """A cache row for a member drafting for the first time (not before: a waiting request
        holds none), in the state made for it; the row returns to the pool when the member is
        released."""
        row = self.taken.index(False) if False in self.taken else len(self.taken)
        rows = max(row + 1, len(self.taken))
        # past every member's capacity, room for the throwaway tokens a row runs while others draft:
        # as wide as the widest forward (a catch-up, or a tree level)
        self.slack = max(self.slack, member.width)
        self.longest = max(self.longest, member.capacity)
        max_len = max(self.longest + self.slack, 0 if self.cache is None else self.cache.max_len)
        if self.cache is None or rows > self.cache.batch_size or max_len > self.cache.max_len:
            self._grow(rows, max_len)
        self.taken += [False] * (rows - len(self.taken))
        self.owners += [[] for _ in range(rows - len(self.owners))]
        self.scopes += [""] * (rows - len(self.scopes))
        self.free_from += [0] * (rows - len(self.free_from))
        self.taken[row], self.owners[row], self.free_from[row] = True, member.tokens, 0
        self.scopes[row] = member.scope
        self.cache.release(row)  # its last member's blocks: some may be the prefix cache's now
        self.members[member] = state = DraftRow(row)
        return state

    def release(self, member: Member) -> None:
        """The member's request ended: its row returns to the pool at the next reclaim (its K/V
        offered to the prefix cache first); a member that never drafted holds none."""
        state = self.members.pop(member, None)
        if state is not None:
            self.released.append(state.row)

    def reclaim(self) -> None:
        """Free the rows of members released, first offering the K/V of their committed tokens to the
        prefix cache."""
        while self.released:
            row = self.released.popleft()
            if self.prefix is not None:
                self.prefix.store(self.owners[row][:self.cache.lengths[row]], self.cache, row,
                                  scope=self.scopes[row])
            self.taken[row], self.owners[row], self.free_from[row] = False, [], 0
            self.cache.release(row)

    def _grow(self, rows: int, max_len: int) -> None:
        """A larger cache holding what the old one held."""
        if self.cache is None:  # in the prefix cache's pool: a hit shares its blocks
            self.cache = self.model.new_cache(rows, max_len) if self.prefix is None else \
                KVCache(self.prefix.pool, rows, max_len)
        else:
            self.cache.reserve(rows, max_len)

    def settle(self, state: DraftRow) -> None:
        """The row holds K/V for exactly its member's first `cached` tokens; the slots after are free."""
        self.cache.lengths[state.row] = self.free_from[state.row] = state.cached

    def row_cache(self, member: Member) -> KVCache:
        """The member's row as a cache of its own (a view: tests read it); empty before its first draft."""
        state = self.of(member)
        if state is None:
            return self.model.new_cache(1, 1)
        return self.cache.rows(state.row, state.row + 1)
