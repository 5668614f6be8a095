"""Token Recycling (Luo et al. 2024): draft from the target's own candidates of earlier passes.

Every pass scores each fed token and each verified draft node, rejected ones included; their top
candidates are kept in an adjacency table [V, K] (for each token, the target's K likeliest next
tokens the last time it was scored), shared by the target's requests of one scope (scoped.py), so
its memory is V x K int32 per scope whatever the traffic. A draft is a tree grown from the newest committed
token through the table: a node's children are its row's candidates in rank order. The tree's
shape follows each rank's measured chance of being accepted (best-first on the chance of reaching
a node, at most k nodes), so it branches near the root and narrows deeper, like the paper's static
template. Deterministic drafts (q one-hot): verification stays exact. Knows no model.

`lookup-recycle` grows the same tree with prompt lookup's candidates first: a node's children are
the tokens that followed earlier occurrences of its text in the request (the draft's path to it
included, so the lookup goes on along the table's guesses too), then its row of the table. Each
kind of candidate (its source, rank and the candidates ahead of it) has a hit rate counted over
all requests, the prior of each new request's own count: how often the lookup is right depends on
how much a text repeats.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.kernels import TOPK_MAX
from quickdraft.proposers.base import EACH, Committed, Draft, ProposerContext, register
from quickdraft.proposers.ngram import NgramOptions, NgramProposer
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.proposers.scoped import scoped
from quickdraft.spec.goodput import Acceptance

EMPTY = -1  # a table row not filled yet


@dataclass(frozen=True)
class RecycleOptions:
    recycle_top: int = option(8, "recycle: the target's candidates kept per token (the table's width)", 1, TOPK_MAX)

    def __post_init__(self) -> None:
        check_ranges(self)


Key = tuple  # a kind of candidate: ("top", rank in the table's row, lookup candidates ahead of it) or
             # ("lookup", match length, rank among the lookup's)


SHARED_WEIGHT = 4.0  # observations a request's own counts need to outweigh the server-wide rate


def prior(key: Key) -> Acceptance:
    """Pseudo-counts before any evidence: 1/(3(i+1)) for the i-th candidate of a node."""
    place = key[1] + key[2] if key[0] == "top" else key[2]
    return Acceptance(1.0 / (place + 1), 3.0)


class Recycled:
    """What the target's requests share: the table [V, K] int32 (per token, the target's candidate
    next tokens the last time it was scored, likeliest first), and per kind of candidate how often
    it was the target's next token over all requests (the prior of each new request's estimates)."""

    def __init__(self, vocab_size: int, top: int) -> None:
        self.table = torch.full((vocab_size, top), EMPTY, dtype=torch.int32)
        self.counts: dict[Key, Acceptance] = {}


class RecycleProposer:
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, prompt_ids: Sequence[int], recycled: Recycled, lookup: NgramProposer | None = None,
                 lookup_top: int = 1) -> None:
        self.recycled = recycled                           # shared with the target's other requests
        self.lookup, self.lookup_top = lookup, lookup_top  # prompt lookup, its followers offered per node
        self.keep = 1 if lookup is None else lookup.max_n  # committed tokens a candidate lookup reads
        self.text = list(prompt_ids[-self.keep:])          # the newest committed ones; the last is a draft's root
        self.counts: dict[Key, Acceptance] = {}            # per kind, how often it was right in this request
        self.pending = Draft([])                           # the last draft
        self.rows: dict[int, list[tuple[int, Key]]] = {}   # its nodes' candidates (-1: the root's)

    def rate(self, key: Key) -> float:
        """The chance that a node's candidate of this kind is the target's next token: this
        request's record, starting from the server-wide rate (texts differ: how often the lookup is
        right depends on how much the text repeats)."""
        own = self.counts.get(key) or Acceptance(0.0, 0.0)
        return own.toward(self.recycled.counts.get(key) or prior(key), SHARED_WEIGHT)

    def candidates(self, tail: Sequence[int]) -> list[tuple[int, Key]]:
        """What may follow a node whose path ends with `tail`: the lookup's followers of the text's
        end, then the table's row of the last token, without repeats."""
        found = [] if self.lookup is None else \
            [(token, ("lookup", n, r)) for r, (n, token) in enumerate(self.lookup.followers(tail, self.lookup_top))]
        offered = {token for token, _ in found}
        found += [(token, ("top", r, len(offered))) for r, token in enumerate(self.recycled.table[tail[-1]].tolist())
                  if token != EMPTY and token not in offered]
        return found

    def propose(self, k: int) -> Draft:
        """Best-first through the candidates: the next node is the one likeliest to be reached and accepted."""
        tokens: list[int] = []
        parents: list[int] = []
        estimates: list[float] = []
        tails = {-1: self.text}
        rows = self.rows = {-1: self.candidates(self.text)}
        frontier = [(-self.rate(rows[-1][0][1]), -1, 0, 1.0)] if rows[-1] else []  # (-reach, parent, index
        while frontier and len(tokens) < k:                                          # in its row, parent's reach)
            _, parent, i, above = heapq.heappop(frontier)
            token, key = rows[parent][i]
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            estimates.append(self.rate(key))
            reach = above * estimates[-1]
            tails[node] = [*tails[parent][1 - self.keep:], token] if self.keep > 1 else [token]
            rows[node] = self.candidates(tails[node])
            if rows[node]:
                heapq.heappush(frontier, (-reach * self.rate(rows[node][0][1]), node, 0, reach))
            if i + 1 < len(rows[parent]):
                heapq.heappush(frontier, (-above * self.rate(rows[parent][i + 1][1]), parent, i + 1, above))
        self.pending = Draft(tokens, None, estimates, parents, scored_whole=True)  # commit reads every top
        return self.pending

    def commit(self, step: Committed) -> None:
        verified = self.pending.tokens[:step.verified]
        if step.top is not None:  # recycle: every scored position's candidates, rejected nodes' too
            table = self.recycled.table
            latest = dict(zip([self.text[-1], *verified], step.top(table.shape[1])))
            table[torch.tensor(list(latest))] = torch.tensor(list(latest.values()), dtype=torch.int32)
        self._learn(step)
        self.pending, self.rows = Draft([]), {}
        self.text = [*self.text, *step.tokens][-self.keep:]
        if self.lookup is not None:
            self.lookup.extend(step.tokens)

    def _learn(self, step: Committed) -> None:
        """Along the accepted path (root first), which of each node's candidates the target's next token was."""
        node, parents = -1, self.pending.tree
        for depth, token in enumerate(step.tokens):
            row = self.rows.get(node)
            if row is None:
                return
            for candidate, key in row:
                for counts in (self.counts.setdefault(key, Acceptance(0.0, 0.0)),
                               self.recycled.counts.setdefault(key, prior(key))):
                    counts.record(candidate == token)
            if depth >= step.drafted:
                return
            node = next(i for i in range(step.verified) if parents[i] == node and self.pending.tokens[i] == token)


def recycled(ctx: ProposerContext) -> Recycled:
    """The table for the options' width shared by the target's requests in ctx's scope."""
    vocab, top = ctx.target.model.config.vocab_size, ctx.options.recycle_top
    return scoped(ctx, ("recycle", vocab, top), lambda: Recycled(vocab, top))


@register("recycle", RecycleOptions,
          about="token recycling: a tree through the target's own top candidates from earlier passes, shared "
                "by all requests")
def make_recycle(ctx: ProposerContext) -> RecycleProposer:
    return RecycleProposer(ctx.prompt_ids, recycled(ctx))


@dataclass(frozen=True)
class LookupRecycleOptions(NgramOptions, RecycleOptions):
    lookup_followers: int = option(2, "lookup-recycle: distinct tokens that followed earlier occurrences of a "
                                      "node's text offered before the table's", 1, 16)


@register("lookup-recycle", LookupRecycleOptions,
          about="token recycling with prompt lookup in one tree: each node's children are what followed its "
                "text earlier in the request, then the target's recycled candidates")
def make_lookup_recycle(ctx: ProposerContext) -> RecycleProposer:
    o = ctx.options
    return RecycleProposer(ctx.prompt_ids, recycled(ctx), NgramProposer(ctx.prompt_ids, o.ngram_max, o.ngram_min),
                           o.lookup_followers)
