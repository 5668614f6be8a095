"""Prompt lookup where the text repeats, a drafter (the draft head, a draft model or the datastore
of the target's answers) elsewhere; and
`auto`, which picks a proposer for the target from what was measured for it.

The two parts are strong in different places: the n-gram proposer is near free and long-reaching
when the answer copies its input or itself (summaries, edits, code completions, loops), a drafter
predicts fresh text. Each step the n-gram proposer offers its draft first; if it expects at least
`NGRAM_ENOUGH` tokens accepted the drafter does not run, otherwise the draft expected to get
further is taken. Both see every committed token, so either can take the next step. Exactness
needs nothing more: the chosen draft carries its own q, and the choice never depends on a sampled
draft token (a draft without estimates is valued by its length and its part's measured agreement).

`hybrid` drafts with the head, `lookup-draft` with a draft model, `lookup-store` from the
datastore (datastore.py): three names, as each loads a different file, which the registry, the
CLI's --head / --draft-model / --datastore and the benchmark's NAME:FILE read from the
registration. Each draft names its part in `Draft.source`, for token origins.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from operator import mul

from quickdraft.proposers.base import (
    EACH,
    PROPOSERS,
    Committed,
    Draft,
    Proposer,
    ProposerContext,
    SpecConfig,
    SpecConfigError,
    Target,
    register,
)
from quickdraft.proposers.datastore import StoreOptions, make_store
from quickdraft.proposers.draft_model import DraftOptions, make_draft
from quickdraft.proposers.head import make_head
from quickdraft.proposers.ngram import NgramOptions, make_ngram
from quickdraft.proposers.registry import registration
from quickdraft.spec.goodput import Acceptance
from quickdraft.spec.sequences import common_prefix

NGRAM_ENOUGH = 1.0  # expected accepted n-gram tokens that make a drafter's forwards not worth running
LOOKUP = "ngram"    # Draft.source of the lookup's drafts


def expected_accepted(draft: Draft, rate: float = 0.0) -> float:
    """Expected number of the draft's tokens accepted, from its per-token estimates (a chain
    without estimates: each token accepted with probability `rate` if its parent is)."""
    estimates = draft.accept_probs if draft.accept_probs is not None else [rate] * len(draft.tokens)
    return sum(accumulate(estimates, mul))


class HybridProposer:
    """While the drafter offers nothing (a head resting after declined drafts, head.Rest) prompt
    lookup drafts alone."""
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, ngram: Proposer, drafter: Proposer, source: str = "head") -> None:
        self.ngram, self.drafter, self.source = ngram, drafter, source
        self.agreement = Acceptance()  # how often the drafter's tokens agree with the committed ones
        self.offered: dict[str, list[int]] = {}  # per part asked this step, its draft's tokens
        self.chosen: str | None = None

    @property
    def parts(self) -> tuple[Proposer, Proposer]:
        """The proposers it drafts through, each released with it (base.Each.release): a draft
        model's holds a row of its drafter's cache."""
        return self.ngram, self.drafter

    def commit(self, step: Committed) -> None:
        if self.source in self.offered:
            self.agreement.judge(self.offered[self.source], step.tokens)
        for source, part in ((LOOKUP, self.ngram), (self.source, self.drafter)):
            # for the part not chosen: `drafted`, those of its own draft's tokens the step committed all
            # the same (a draft model keeps their K/V); `verified` 0, as none of its draft was (a head
            # that ran for a draft not taken rests as for one the engine declined: head.Rest)
            if source == self.chosen:
                part.commit(step)
            else:
                part.commit(replace(step, drafted=common_prefix(self.offered.get(source, []), step.tokens[:-1]),
                                    verified=0))
        self.offered, self.chosen = {}, None

    def propose(self, k: int) -> Draft:
        lookup = self.ngram.propose(k)
        self.offered = {LOOKUP: lookup.tokens}
        lookup_gain = expected_accepted(lookup)
        if lookup_gain >= NGRAM_ENOUGH:
            return self._choose(lookup, LOOKUP)
        drafted = self.drafter.propose(k)
        self.offered[self.source] = drafted.tokens
        if lookup_gain >= expected_accepted(drafted, self.agreement.rate):
            return self._choose(lookup, LOOKUP)
        return self._choose(drafted, self.source)

    def _choose(self, draft: Draft, source: str) -> Draft:
        self.chosen = source if draft.tokens else None
        return replace(draft, source=source) if draft.tokens else draft


@register("hybrid", NgramOptions, loads="head", needs_file=True,
          about="prompt lookup where the text repeats, the draft head elsewhere")
def make_hybrid(ctx: ProposerContext) -> HybridProposer:
    return HybridProposer(make_ngram(ctx), make_head(ctx), "head")


@dataclass(frozen=True)
class LookupDraftOptions(NgramOptions, DraftOptions):
    """Prompt lookup's n-gram sizes and the draft model's vocabulary."""


@register("lookup-draft", LookupDraftOptions, loads="draft_model", needs_file=True,
          about="prompt lookup where the text repeats, a draft model elsewhere")
def make_lookup_draft(ctx: ProposerContext) -> HybridProposer:
    return HybridProposer(make_ngram(ctx), make_draft(ctx), "draft")


@dataclass(frozen=True)
class LookupStoreOptions(NgramOptions, StoreOptions):
    """Prompt lookup's n-gram sizes and the datastore's shortest context (NgramOptions checks both)."""


@register("lookup-store", LookupStoreOptions, loads="datastore", needs_file=True,
          about="prompt lookup where the text repeats, the target's own answers (the datastore) elsewhere")
def make_lookup_store(ctx: ProposerContext) -> HybridProposer:
    return HybridProposer(make_ngram(ctx), make_store(ctx), "store")


@dataclass(frozen=True)
class Measured:
    """The proposer that won the benchmark for one packaged target, and where that is recorded."""
    method: str    # a registered proposer name
    evidence: str  # the file under docs/ and the section with the table and command


# What `auto` runs for a packaged target: measured, never guessed (each entry names its benchmark).
# Targets not listed get the hybrid where a head ships for them, else prompt lookup.
AUTO_MEASURED: dict[str, Measured] = {
    # prompt lookup and the 1.5B's own answers: 1.33x on HumanEval 0-19 and 1.22x over Spec-Bench's
    # groups and code_edit, prompt lookup alone 1.23x and 1.18x in the same runs (its 0.5B draft
    # with prompt lookup first: 1.25x and 1.10x on 2026-11-30)
    "qwen2.5-coder-1.5b": Measured("lookup-store", "docs/notes/qwen-pair.md, 'The 1.5B's own answers as a "
                                                   "datastore'"),
    # prompt lookup and SmolLM2's own answers: 1.41x on held-out ShareGPT against the head's hybrid
    # 1.29x and prompt lookup's 1.22x; on Spec-Bench 1.24x, 1.26x and 1.24x (a tie)
    "smollm2-135m": Measured("lookup-store", "docs/notes/smollm2.md, 'The datastore of SmolLM2's own answers'"),
}


def usable(method: str, target: Target, config: SpecConfig) -> bool:
    """Whether the file `method` drafts from loads for this target: a datastore that ships for it
    (one named must load, or its error says why; other files are loaded where they are run)."""
    if registration(method).loads != "datastore" or config.datastore:
        return True
    try:
        target.datastore(config.datastore)
    except SpecConfigError:
        return False
    return True


def auto_pick(target: Target, config: SpecConfig) -> str:
    """The proposer `auto` runs for this target: the measured one (unless a head is named, or its
    datastore is missing), else the hybrid where a head ships for it or is named, else prompt lookup."""
    measured = AUTO_MEASURED.get(target.name or "")
    if measured is not None and not config.head and usable(measured.method, target, config):
        return measured.method
    if not config.head:
        try:
            target.draft_head()
        except SpecConfigError:
            return "ngram"
    return "hybrid"


@register("auto", LookupStoreOptions, loads="head", picks=auto_pick,
          about="the proposer measured best for the model (docs/results.md); else the hybrid where a "
                "draft head ships for it (or one is named), else prompt lookup")
def make_auto(ctx: ProposerContext) -> Proposer:
    picked = auto_pick(ctx.target, ctx.config)
    return PROPOSERS[picked].factory(replace(ctx, config=replace(ctx.config, method=picked)))
