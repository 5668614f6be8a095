"""Prompt lookup where the text repeats, the draft head everywhere else.

The two are strong in different places: the n-gram proposer is near free and long-reaching when
the answer copies its input or itself (summaries, edits, loops), the head predicts fresh text.
Each step the n-gram proposer offers its draft first; if it expects at least `NGRAM_ENOUGH` tokens
accepted the head does not run, otherwise the draft expected to get further is taken. Both see
every committed token, so either can take the next step (the head catches up on skipped steps in
its next forward). Exactness needs nothing more: the chosen draft carries its own q.
"""
from __future__ import annotations

from itertools import accumulate
from operator import mul

from quickdraft.proposers.base import Committed, Draft, ProposerContext, SpecConfigError, register
from quickdraft.proposers.head import HeadProposer, make_head
from quickdraft.proposers.ngram import NgramOptions, NgramProposer, make_ngram

NGRAM_ENOUGH = 1.0  # expected accepted n-gram tokens that make a head forward not worth running


def expected_accepted(draft: Draft) -> float:
    """Expected number of the draft's tokens accepted, from its per-token estimates."""
    return sum(accumulate(draft.accept_probs or [], mul))


class HybridProposer:
    """While the head rests after declined drafts (head.Rest) it offers nothing, and prompt lookup
    drafts alone."""
    group = None  # drafts alone (proposers/base.py: ProposerGroup)

    def __init__(self, ngram: NgramProposer, head: HeadProposer) -> None:
        self.ngram, self.head = ngram, head

    def commit(self, step: Committed) -> None:
        self.ngram.commit(step)
        self.head.commit(step)

    def propose(self, k: int) -> Draft:
        lookup = self.ngram.propose(k)
        lookup_gain = expected_accepted(lookup)
        if lookup_gain >= NGRAM_ENOUGH:
            return lookup
        drafted = self.head.propose(k)
        return lookup if lookup_gain >= expected_accepted(drafted) else drafted


@register("hybrid", NgramOptions, loads="head", needs_file=True,
          about="prompt lookup where the text repeats, the draft head elsewhere")
def make_hybrid(ctx: ProposerContext) -> HybridProposer:
    return HybridProposer(make_ngram(ctx), make_head(ctx))


@register("auto", NgramOptions, loads="head",
          about="the hybrid where a draft head ships for the model (or one is named), else prompt lookup")
def make_auto(ctx: ProposerContext) -> HybridProposer | NgramProposer:
    """The hybrid where a head ships for the target (or one is named), else prompt lookup alone."""
    if not ctx.config.head:
        try:
            ctx.target.draft_head()
        except SpecConfigError:
            return make_ngram(ctx)
    return make_hybrid(ctx)
