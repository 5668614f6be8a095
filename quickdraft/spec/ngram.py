"""N-gram prompt lookup: propose what followed the last earlier occurrence of the current suffix.

Pure Python over token ids (no model, no torch in the hot path). Example, max_n = 3:

    sequence: [5 9 2 7 1 5 9 2]          suffix [5 9 2] occurred before, ending at index 2
    proposal (k=3): [7 1 5]              the tokens that followed that occurrence

If no suffix of length max_n..min_n occurred before, it proposes nothing and the engine's step is
a plain decoding step, so a miss costs a dictionary lookup per n.

It also learns, per match length, how often its tokens agree with what the target commits (also
for tokens the engine chose not to verify: the committed text shows whether they would have been
accepted) and reports that as the draft's `accept_probs`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from quickdraft.spec.base import NO_DRAFT, Agreement, Committed, Draft, ProposerContext, register


@dataclass(frozen=True)
class NgramOptions:
    ngram_max: int = field(default=4, metadata={"help": "n-gram proposer: longest suffix matched"})
    ngram_min: int = field(default=1, metadata={"help": "n-gram proposer: shortest suffix matched"})

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max <= 16, "
                             f"found {self.ngram_min}, {self.ngram_max}")


class NgramProposer:
    def __init__(self, prompt_ids: Sequence[int], max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n-gram -> end index of its latest occurrence, over n-grams ending before the last token,
        # so a lookup of the current suffix finds an *earlier* occurrence.
        self.last_end: dict[tuple[int, ...], int] = {}
        self.agreement: dict[int, Agreement] = {}            # per match length
        self.pending: tuple[int, list[int]] | None = None    # (match length, tokens) last proposed
        self._extend(prompt_ids)

    def _extend(self, new: Sequence[int]) -> None:
        for t in new:
            end = len(self.tokens) - 1  # index the n-grams ending at the previous last token
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    self.last_end[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(t)

    def propose(self, k: int) -> Draft:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                proposal = tokens[end + 1:end + 1 + k]
                self.pending = (n, proposal)
                return Draft(proposal, None, [self.agreement.setdefault(n, Agreement()).rate] * len(proposal))
        return NO_DRAFT

    def commit(self, step: Committed) -> None:
        if self.pending is not None:
            n, proposal = self.pending
            self.agreement.setdefault(n, Agreement()).record(proposal, step.tokens)
            self.pending = None
        self._extend(step.tokens)


@register("ngram", NgramOptions, about="prompt lookup: what followed the last earlier occurrence of the text's end")
def make_ngram(ctx: ProposerContext) -> NgramProposer:
    options = ctx.options
    return NgramProposer(ctx.prompt_ids, options.ngram_max, options.ngram_min)
