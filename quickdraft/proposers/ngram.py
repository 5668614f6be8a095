"""N-gram prompt lookup: propose what followed earlier occurrences of the current suffix.

Pure Python over token ids (no model, no torch in the hot path). Example, max_n = 3:

    sequence: [5 9 2 7 1 5 9 2]          suffix [5 9 2] occurred before, ending at index 2
    proposal (k=3): [7 1 5]              the tokens that followed that occurrence

`ngram` proposes the continuation of the latest occurrence of the longest suffix that occurred
before. `ngram-tree` takes the continuations of up to `ngram_branches` occurrences (longest match
first, the latest first among equals) and merges them into a trie of at most k nodes, grown where
the estimated chance of reaching a node is highest: where the text went on differently after the
same words, the tree keeps both ways. If no suffix of length max_n..min_n occurred before, it
proposes nothing and the engine's step is a plain decoding step, so a miss costs a dictionary
lookup per n.

It also learns, per match length and occurrence rank, how often its tokens agree with what the
target commits (also for tokens the engine chose not to verify: the committed text shows whether
they would have been accepted) and reports that as the draft's `accept_probs`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from quickdraft.proposers.base import EACH, Committed, Draft, ProposerContext, register
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.spec.goodput import Acceptance


@dataclass(frozen=True)
class NgramOptions:
    ngram_max: int = option(4, "n-gram proposer: longest suffix matched", 1, 16)
    ngram_min: int = option(1, "n-gram proposer: shortest suffix matched", 1, 16)

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"n-gram sizes need ngram_min <= ngram_max, found {self.ngram_min}, {self.ngram_max}")


@dataclass(frozen=True)
class NgramTreeOptions(NgramOptions):
    ngram_branches: int = option(4, "ngram-tree: earlier occurrences whose continuations are merged into the tree",
                                 1, 64)


SCANNED = 16  # occurrences of one n-gram looked at for distinct followers (a frequent token has hundreds)

Continuation = tuple[float, list[int]]  # (estimated chance each token is accepted, the tokens)


def merge(continuations: Sequence[Continuation], k: int) -> Draft:
    """A trie of at most k nodes over the continuations (best first), grown node by node where the
    chance of reaching it is highest: a node's estimate is its continuation's, times the chance
    that no earlier sibling is accepted. One continuation gives a chain."""
    tokens: list[int] = []
    parents: list[int] = []
    estimates: list[float] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    missed: dict[int, float] = {}              # per node (-1 = root): chance no child so far is accepted
    reach = {-1: 1.0}                          # per node: chance it is reached and accepted
    frontier = [(-a, c, 0, -1) for c, (a, cont) in enumerate(continuations) if cont]
    heapq.heapify(frontier)                    # (-reach of the next node, continuation, depth, parent)
    while frontier and len(tokens) < k:
        _, c, depth, parent = heapq.heappop(frontier)
        a, cont = continuations[c]
        node = node_of.get((parent, cont[depth]))
        if node is None:  # a new node; else the continuation runs along an earlier one's
            estimate = a * missed.get(parent, 1.0)
            missed[parent] = missed.get(parent, 1.0) * (1.0 - a)
            node = node_of[(parent, cont[depth])] = len(tokens)
            tokens.append(cont[depth])
            parents.append(parent)
            estimates.append(estimate)
            reach[node] = reach[parent] * estimate
        if depth + 1 < len(cont):
            heapq.heappush(frontier, (-reach[node] * a, c, depth + 1, node))
    return Draft(tokens, None, estimates, parents)


class NgramProposer:
    group = EACH  # drafts alone (proposers/base.py)
    def __init__(self, prompt_ids: Sequence[int], max_n: int = 4, min_n: int = 1, branches: int = 1) -> None:
        self.max_n, self.min_n, self.branches = max_n, min_n, branches
        self.tokens: list[int] = []
        # n-gram -> end indices of its occurrences (latest last), over n-grams ending before the
        # last token, so a lookup of the current suffix finds *earlier* occurrences.
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.agreement: dict[tuple[int, int], Acceptance] = {}  # per (match length, occurrence rank)
        self.pending: list[tuple[tuple[int, int], list[int]]] = []  # (its key, tokens) last proposed
        self.extend(prompt_ids)

    def extend(self, new: Sequence[int]) -> None:
        for t in new:
            end = len(self.tokens) - 1  # index the n-grams ending at the previous last token
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    self.ends.setdefault(tuple(self.tokens[end - n + 1:end + 1]), []).append(end)
            self.tokens.append(t)

    def continuations(self, k: int) -> list[tuple[tuple[int, int], list[int]]]:
        """Up to `branches` ((match length, rank), the k tokens that followed) for earlier
        occurrences of the text's end: the longest match first, the latest first among equals."""
        tokens, found, seen = self.tokens, [], set()
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            for end in reversed(self.ends.get(tuple(tokens[-n:]), ())):
                if end not in seen:  # a longer match's occurrence is a shorter one's too
                    seen.add(end)
                    found.append(((n, len(found)), tokens[end + 1:end + 1 + k]))
                    if len(found) == self.branches:
                        return found
        return found

    def followers(self, text: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """Up to `limit` distinct (match length, token) that followed earlier occurrences of the end
        of `text` (the committed sequence, maybe extended by a draft's path): the longest match
        first, the latest first among equals, at most SCANNED occurrences looked at per length."""
        found: list[tuple[int, int]] = []
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            for end in self.ends.get(tuple(text[len(text) - n:]), ())[-1:-SCANNED - 1:-1]:
                token = self.tokens[end + 1]
                if all(token != t for _, t in found):
                    found.append((n, token))
                    if len(found) == limit:
                        return found
        return found

    def propose(self, k: int) -> Draft:
        self.pending = self.continuations(k)
        return merge([(self.agreement.setdefault(key, Acceptance()).rate, cont) for key, cont in self.pending], k)

    def commit(self, step: Committed) -> None:
        for key, proposal in self.pending:
            self.agreement.setdefault(key, Acceptance()).judge(proposal, step.tokens)
        self.pending = []
        self.extend(step.tokens)


@register("ngram", NgramOptions, about="prompt lookup: what followed the last earlier occurrence of the text's end")
def make_ngram(ctx: ProposerContext) -> NgramProposer:
    options = ctx.options
    return NgramProposer(ctx.prompt_ids, options.ngram_max, options.ngram_min)


@register("ngram-tree", NgramTreeOptions,
          about="prompt lookup as a tree: the continuations of several earlier occurrences, merged")
def make_ngram_tree(ctx: ProposerContext) -> NgramProposer:
    options = ctx.options
    return NgramProposer(ctx.prompt_ids, options.ngram_max, options.ngram_min, options.ngram_branches)
