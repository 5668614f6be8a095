"""The proposer protocol, SpecConfig and the registry of proposers.

A proposer guesses the next tokens of one request; the engine verifies them with the target.
It must not know the engine's loop: it is told the committed tokens and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams

HEAD_REQUIRED = ("head", "hybrid")        # the proposers that cannot run without a draft head
HEAD_PROPOSERS = (*HEAD_REQUIRED, "auto")  # the proposers that may run one (take --head)
MAX_K = 32  # verifying more than this many tokens per pass costs more than it can win here


class SpecConfigError(QuickdraftError, ValueError):
    """Invalid speculative-decoding settings (unknown proposer, bad k, unusable draft model)."""


@dataclass
class Draft:
    tokens: list[int]            # up to k proposed tokens (may be empty: then the step is plain)
    q: torch.Tensor | None       # [len(tokens), V] proposer probabilities; None = deterministic
    accept_probs: Sequence[float] | None = None  # per token, the proposer's estimate that it is
                                                 # accepted if the ones before it are; when given,
                                                 # the engine may verify only a prefix (policy.py)
    costly: bool = False         # drafting it ran a model (a head, a draft model): declined, that
                                 # work was for nothing, and the engine lets the proposer rest

    def prefix(self, n: int) -> "Draft":
        if n == len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n],
                     None if self.accept_probs is None else self.accept_probs[:n], self.costly)


class Agreement:
    """How often a proposer's tokens agree with what the target commits: per proposal, the drafts
    before the first disagreement count as agreeing (also drafts the engine chose not to verify:
    the committed text shows whether they would have been accepted), a disagreement counts once.
    Pseudo-counts (1, 2) make the estimate 1/3 before any evidence."""

    def __init__(self) -> None:
        self.agreed, self.disagreed = 1.0, 2.0

    @property
    def rate(self) -> float:
        return self.agreed / (self.agreed + self.disagreed)

    def record(self, proposal: Sequence[int], committed: Sequence[int]) -> None:
        agreed = 0
        for drafted, token in zip(proposal, committed):
            if drafted != token:
                break
            agreed += 1
        self.agreed += agreed
        self.disagreed += agreed < min(len(proposal), len(committed))


class Proposer(Protocol):
    def propose(self, k: int) -> Draft:
        """Up to k tokens that may follow the committed sequence."""

    def commit(self, tokens: Sequence[int], accepted: int) -> None:
        """`tokens` were appended to the sequence; the first `accepted` of them were drafts of this
        proposer's last proposal (possibly cut short by the engine), the last one is the target's.
        After declining a `costly` draft the engine asks the proposer again only after a few
        steps; meanwhile it asks the proposer's `cheap` part, if it has one (a proposer that runs
        no model and sees the same commits, as the hybrid's prompt lookup).
        A proposer with `wants_hidden = True` is called commit(tokens, accepted, hidden), hidden
        [n, D] being the target's last-layer features at the n positions the step ran and kept
        (the whole prompt after the prefill, then the fed token and the accepted drafts)."""


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"          # a registry name; "none" = plain decoding
    k: int = 4                    # draft tokens per step
    draft_model: str | None = None  # None: the target's packaged draft, if it has one (LLM.draft_name)
    head: str | None = None       # a trained draft head's directory (proposer "head"; None = the
                                  # head that ships for the target, if one does)
    ngram_max: int = 4            # n-gram proposer: longest suffix to match ...
    ngram_min: int = 2            # ... down to this length (1-token matches rarely pay)
    adaptive: bool = True         # verify only the draft prefix expected to pay for itself

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS and self.method != "none":
            raise SpecConfigError(f"unknown proposer {self.method!r}; valid names: "
                                  f"{', '.join(['none', *sorted(PROPOSERS)])}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_K:
            raise SpecConfigError(f"k must be an integer in 0..{MAX_K}, found {self.k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise SpecConfigError(f"n-gram sizes need 1 <= ngram_min <= ngram_max <= 16, "
                                  f"found {self.ngram_min}, {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.k > 0

    @property
    def needs_head(self) -> bool:
        """A draft head must load: the proposer cannot do without one, or one is named."""
        return self.enabled and (self.method in HEAD_REQUIRED or (self.method in HEAD_PROPOSERS and bool(self.head)))


@dataclass
class ProposerContext:
    """What a proposer factory may use to start on one request."""
    prompt_ids: list[int]
    params: SamplingParams
    config: SpecConfig
    target: Any                  # quickdraft.api.LLM: .model, .tokenizer, .draft_model(path)


ProposerFactory = Callable[[ProposerContext], Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory
    return wrap
