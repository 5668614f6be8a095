"""Token Recycling (Luo et al. 2024): draft from the target's own candidates of earlier passes.

Every pass scores each fed token and each verified draft node, rejected ones included; their top
candidates are kept in an adjacency table [V, K] (for each token, the target's K likeliest next
tokens the last time it was scored), shared by every request of the target (`Target.shared`), so
its memory is V x K int32 whatever the traffic. A draft is a tree grown from the newest committed
token through the table: a node's children are its row's candidates in rank order. The tree's
shape follows each rank's measured chance of being accepted (best-first on the chance of reaching
a node, at most k nodes), so it branches near the root and narrows deeper, like the paper's static
template. Deterministic drafts (q one-hot): verification stays exact. Knows no model.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.proposers.base import Committed, Draft, ProposerContext, register
from quickdraft.proposers.registry import check_ranges, option

EMPTY = -1  # a table row not filled yet


@dataclass(frozen=True)
class RecycleOptions:
    recycle_top: int = option(8, "recycle: the target's candidates kept per token (the table's width)", 1, 32)

    def __post_init__(self) -> None:
        check_ranges(self)


def new_table(vocab_size: int, top: int) -> torch.Tensor:
    """[V, K] int32: per token, the target's candidate next tokens, likeliest first."""
    return torch.full((vocab_size, top), EMPTY, dtype=torch.int32)


class RecycleProposer:
    group = None  # drafts alone (proposers/base.py: ProposerGroup)

    def __init__(self, prompt_ids: Sequence[int], table: torch.Tensor) -> None:
        self.table = table                                # [V, K], shared with the target's other requests
        self.last = prompt_ids[-1]                         # the newest committed token: the root of a draft
        self.right = [1.0 / (r + 1) for r in range(table.shape[1])]  # per rank: times the target's next
        self.seen = 3.0                                    # token was it, of `seen` (pseudo-counts: 1/(3(r+1)))
        self.pending = Draft([])                           # the last draft
        self.rows: dict[int, list[int]] = {}               # its nodes' candidate rows (-1: the root's)

    def rate(self, rank: int) -> float:
        """The chance that a node's candidate of this rank is the target's next token."""
        return self.right[rank] / self.seen

    def propose(self, k: int) -> Draft:
        """Best-first through the table: the next node is the one likeliest to be reached and accepted."""
        tokens: list[int] = []
        parents: list[int] = []
        estimates: list[float] = []
        rows = self.rows = {-1: self.table[self.last].tolist()}
        frontier = [(-self.rate(0), -1, 0, 1.0)]           # (-reach, parent, rank, reach of the parent)
        while frontier and len(tokens) < k:
            _, parent, rank, above = heapq.heappop(frontier)
            token = rows[parent][rank]
            if token == EMPTY:  # a row never filled: no candidates
                continue
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            estimates.append(self.rate(rank))
            reach = above * self.rate(rank)
            rows[node] = self.table[token].tolist()
            heapq.heappush(frontier, (-reach * self.rate(0), node, 0, reach))
            if rank + 1 < len(rows[parent]):
                heapq.heappush(frontier, (-above * self.rate(rank + 1), parent, rank + 1, above))
        self.pending = Draft(tokens, None, estimates, parents)
        return self.pending

    def commit(self, step: Committed) -> None:
        verified = self.pending.tokens[:step.verified]
        if step.top is not None:  # recycle: every scored position's candidates, rejected nodes' too
            latest = dict(zip([self.last, *verified], step.top(self.table.shape[1])))
            self.table[torch.tensor(list(latest))] = torch.tensor(list(latest.values()), dtype=torch.int32)
        self._learn(step)
        self.pending, self.rows = Draft([]), {}
        self.last = step.tokens[-1]

    def _learn(self, step: Committed) -> None:
        """Along the accepted path (root first), the rank the target's next token had in each node's row."""
        node, parents = -1, self.pending.tree
        for depth, token in enumerate(step.tokens):
            row = self.rows.get(node)
            if row is None:
                return
            self.seen += 1
            if token in row:
                self.right[row.index(token)] += 1
            if depth >= step.drafted:
                return
            node = next(i for i in range(step.verified) if parents[i] == node and self.pending.tokens[i] == token)


@register("recycle", RecycleOptions,
          about="token recycling: a tree through the target's own top candidates from earlier passes, shared "
                "by all requests")
def make_recycle(ctx: ProposerContext) -> RecycleProposer:
    top = ctx.options.recycle_top
    vocab = ctx.target.model.config.vocab_size
    return RecycleProposer(ctx.prompt_ids, ctx.target.shared(("recycle", vocab, top), lambda: new_table(vocab, top)))
