"""Suffix decoding: draft what followed the text's end in this server's earlier responses too.

A corpus of recent responses is shared by the target's requests of one scope (scoped.py), kept to
a token budget and a number of responses (the oldest leave first), and indexed by n-gram as
prompt lookup indexes a request's own text. A draft merges (ngram.merge) the continuations of the
longest matches of the text's end, in the request's own prompt and output (prompt lookup) and in
the corpus, into one tree. Deterministic drafts (q one-hot): verification stays exact. Knows no
model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quickdraft.proposers.base import (
    EACH,
    Committed,
    Draft,
    ProposerContext,
    register,
)
from quickdraft.proposers.ngram import NgramProposer, NgramTreeOptions, merge
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.proposers.scoped import scoped
from quickdraft.spec.goodput import Acceptance

Found = tuple[tuple[str, int, int], list[int]]  # ((where, match length, rank), the tokens that followed)


@dataclass(frozen=True)
class SuffixOptions(NgramTreeOptions):
    suffix_tokens: int = option(32768, "suffix: tokens of earlier responses kept for lookup", 1, 1 << 24)
    suffix_responses: int = option(256, "suffix: earlier responses kept for lookup", 1, 1 << 16)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self)


class Corpus:
    """Recent responses, indexed by their n-grams (min_n..max_n): at most `max_tokens` tokens in at
    most `max_docs` responses, so its memory is bounded by max_tokens x (max_n - min_n + 1) entries."""

    def __init__(self, max_tokens: int, max_docs: int, max_n: int, min_n: int) -> None:
        self.max_tokens, self.max_docs, self.max_n, self.min_n = max_tokens, max_docs, max_n, min_n
        self.docs: dict[int, list[int]] = {}                      # id -> tokens, oldest first
        self.index: dict[tuple[int, ...], dict[int, list[int]]] = {}  # n-gram -> doc -> end indices
        self.size = 0
        self.next_id = 0

    def open(self) -> int:
        """A new, empty response; its id for `extend`."""
        doc = self.next_id
        self.next_id += 1
        self.docs[doc] = []
        self._evict()
        return doc

    def extend(self, doc: int, new: Sequence[int]) -> None:
        """Append to a response (nothing if it was evicted), then evict the oldest over budget."""
        tokens = self.docs.get(doc)
        if tokens is None:
            return
        for t in new:
            tokens.append(t)
            end = len(tokens) - 1  # the n-grams ending at the new token: their continuation comes next
            for n in range(self.min_n, min(self.max_n, len(tokens)) + 1):
                self.index.setdefault(tuple(tokens[end - n + 1:]), {}).setdefault(doc, []).append(end)
        self.size += len(new)
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_tokens or len(self.docs) > self.max_docs:
            doc, tokens = next(iter(self.docs.items()))
            del self.docs[doc]
            self.size -= len(tokens)
            for end in range(len(tokens)):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    key = tuple(tokens[end - n + 1:end + 1])
                    docs = self.index.get(key)
                    if docs is not None and docs.pop(doc, None) is not None and not docs:
                        del self.index[key]

    def continuations(self, text: Sequence[int], k: int, branches: int, skip: int) -> list[Found]:
        """Up to `branches` continuations (k tokens at most) of the longest suffix of `text` found in
        a response other than `skip`: the newest response first, its latest occurrence first."""
        found: list[Found] = []
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            docs = self.index.get(tuple(text[len(text) - n:]), {})
            for doc in sorted(docs, reverse=True):
                tokens = self.docs[doc]
                for end in reversed(docs[doc]):
                    if doc != skip and end + 1 < len(tokens):
                        found.append((("corpus", n, len(found)), tokens[end + 1:end + 1 + k]))
                        if len(found) == branches:
                            return found
            if found:  # the longest match only: shorter ones are weaker evidence
                return found
        return found


class SuffixProposer:
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, prompt_ids: Sequence[int], corpus: Corpus, max_n: int = 4, min_n: int = 1,
                 branches: int = 4) -> None:
        self.own = NgramProposer(prompt_ids, max_n, min_n, branches)  # the request's own prompt and output
        self.corpus = corpus
        self.branches = branches
        # The response joins the corpus as it commits: a proposer is never told that its request
        # ended (the engine commits only to rows that go on; a cancel just drops the row), and
        # requests running at the same time can draft from each other's text at once.
        self.doc = corpus.open()
        self.agreement: dict[tuple[str, int, int], Acceptance] = {}  # per (where, match length, rank)
        self.pending: list[Found] = []

    def propose(self, k: int) -> Draft:
        own: list[Found] = [(("own", n, rank), cont) for (n, rank), cont in self.own.continuations(k)]
        found = own + self.corpus.continuations(self.own.tokens, k, self.branches, self.doc)
        found.sort(key=lambda f: -f[0][1])  # the longest matches first, own text first among equals (stable)
        self.pending = found[:self.branches]
        return merge([(self.agreement.setdefault(key, Acceptance()).rate, cont) for key, cont in self.pending], k)

    def commit(self, step: Committed) -> None:
        for key, proposal in self.pending:
            self.agreement.setdefault(key, Acceptance()).judge(proposal, step.tokens)
        self.pending = []
        self.own.commit(step)
        self.corpus.extend(self.doc, step.tokens)


@register("suffix", SuffixOptions,
          about="suffix decoding: prompt lookup over the request's text and this server's recent responses, as a tree")
def make_suffix(ctx: ProposerContext) -> SuffixProposer:
    o = ctx.options
    corpus = scoped(ctx, ("suffix", o.suffix_tokens, o.suffix_responses, o.ngram_max, o.ngram_min),
                    lambda: Corpus(o.suffix_tokens, o.suffix_responses, o.ngram_max, o.ngram_min))
    return SuffixProposer(ctx.prompt_ids, corpus, o.ngram_max, o.ngram_min, o.ngram_branches)
