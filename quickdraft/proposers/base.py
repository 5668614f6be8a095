"""The proposer protocol: drafts (token trees), the record a proposer is committed, SpecConfig.

A proposer guesses the next tokens of one request; the engine verifies them with the target.
It must not know the engine's loop: it is told what was committed and nothing else.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence, TypeVar

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.kernels import topk_indices
from quickdraft.model.llama import Transformer
from quickdraft.prefix_cache import PrefixCache
from quickdraft.sampling import SamplingParams
from quickdraft.proposers.registry import PROPOSERS, option_names, register, registration
from quickdraft.sequences import common_prefix

T = TypeVar("T")

MAX_K = 32     # verifying more than this many tokens per pass costs more than it can win here
DEFAULT_K = 8  # draft tokens (tree nodes) per step at most, unless asked otherwise
# The proposer when none is named, in Python (SpecConfig()), the CLI and the server alike: prompt
# lookup, the fastest measured on a CPU (docs/notes/smollm2.md, Spec-Bench and bench serve: the shipped
# head does not pay for its drafting yet, alone or in the hybrid); "none" is plain decoding.
DEFAULT_METHOD = "ngram"


class SpecConfigError(QuickdraftError, ValueError):
    """Invalid speculative-decoding settings (unknown proposer, bad k, unusable draft model)."""


@dataclass(frozen=True)
class Draft:
    """A tree of proposed tokens. Node i holds tokens[i] and hangs under node parents[i], -1 being
    the root (the newest committed token, whose successor the target scores first). Parents come
    before their children, so every prefix of the nodes is a tree too (the policy verifies a
    prefix); siblings are verified in node order. A chain has parents i-1 (parents None)."""
    tokens: list[int]            # [n] node tokens (may be empty: then the step is plain)
    q: torch.Tensor | None = None  # [n, V] the distribution each node's token was drawn from (given
                                   # its parent's path); None = deterministic (q = one-hot(token))
    accept_probs: Sequence[float] | None = None  # [n] per node, the proposer's estimate that it is
                                                 # accepted if its parent is; when given, the engine
                                                 # may verify only a prefix (policy.py)
    parents: list[int] | None = None  # [n] parent node per node, -1 = the root; None = a chain
    source: str | None = None  # which part drafted it, where a proposer has several (the hybrid's
                               # "ngram", "head", "draft"); token origins carry it

    def __post_init__(self) -> None:
        assert self.parents is None or (len(self.parents) == len(self.tokens) and
                                        all(-1 <= p < i for i, p in enumerate(self.parents)))

    @property
    def tree(self) -> list[int]:
        """parents, spelled out for a chain too."""
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else self.parents

    @property
    def is_chain(self) -> bool:
        return self.parents is None or all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """[n] per node, its distance from the root (1 for the root's children)."""
        depths: list[int] = []
        for p in self.tree:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def prefix(self, n: int) -> Draft:
        """The first n nodes (a tree: parents precede children)."""
        if n == len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n],
                     None if self.accept_probs is None else self.accept_probs[:n],
                     None if self.parents is None else self.parents[:n], self.source)


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class PassCost:
    """What verifying costs in the step a proposer drafts for next, from the engine's measured
    step times: for proposers whose drafting costs forwards (proposers/draft_cost.py)."""
    seconds: float    # a target pass of the step's rows without drafts
    per_token: float  # the pass's seconds per fed draft token more
    rows: int         # rows in the pass (each commits one token at least)


@dataclass(frozen=True)
class Committed:
    """What one engine step appended to a request's sequence, as its proposer is told."""
    tokens: list[int]     # the accepted drafts (root to leaf), then the target's recovered or bonus token
    drafted: int          # how many of `tokens` came from the proposer's last draft (the accepted ones)
    verified: int         # draft nodes the target verified (0: the engine declined the draft, or none came)
    features: torch.Tensor  # [n, D] the target's last-layer features at the positions the step ran and
                            # kept: the whole prompt after the prefill, then the fed token and the
                            # accepted drafts (draft heads read them; others ignore them)
    top: Callable[[int], list[list[int]]] | None = None  # top(n): [m][n] the target's n likeliest next
                            # tokens (likeliest first) at each of the m positions the step scored: the
                            # fed token, then every verified draft node in node order, rejected ones
                            # included (after the prefill: the prompt's last token); None: not kept
    cost: PassCost | None = None  # what verifying costs the pass the next draft goes to, for the rows it
                            # will have (set when the proposer is asked); None: the draft's length must
                            # not depend on timing (the engine verifies whole drafts for this request)


class TopTokens:
    """The target's likeliest next tokens at the positions one pass scored, for each of its rows:
    made on the first ask (`Committed.top`) for every row at once, so a step costs one top-k and one
    host sync when some proposer asks, nothing when none does."""

    def __init__(self, logits: torch.Tensor, scored: Sequence[int]) -> None:  # logits [B, W, V]
        self.logits, self.scored = logits, scored  # scored[b]: row b's positions (1 + verified nodes)
        self.ids: dict[int, list[list[list[int]]]] = {}  # n -> [B][W][n]

    def row(self, b: int) -> Callable[[int], list[list[int]]]:
        return lambda n: self._top(n)[b][:self.scored[b]]

    def _top(self, n: int) -> list[list[list[int]]]:
        if n not in self.ids:
            self.ids[n] = topk_indices(self.logits, n).tolist()  # the one host sync for it this step
        return self.ids[n]


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
        agreed = common_prefix(proposal, committed)
        self.agreed += agreed
        self.disagreed += agreed < min(len(proposal), len(committed))


class Proposer(Protocol):
    group: ProposerGroup | None  # proposers of one group are asked for their drafts in one call (a
                                 # draft model runs one forward per draft step for all of them);
                                 # None: this proposer drafts alone

    def propose(self, k: int) -> Draft:
        """A tree of at most k nodes that may follow the committed sequence."""

    def commit(self, step: Committed) -> None:
        """The engine appended step.tokens to the sequence (after the prefill: the first token)."""


class ProposerGroup(Protocol):
    def propose(self, members: Sequence[Any], ks: Sequence[int]) -> list[Draft]:
        """What members[i].propose(ks[i]) gives, for every member at once (members are proposers
        whose `group` is this one, each committed its step already)."""


@dataclass(frozen=True)
class Proposal:
    draft: Draft = NO_DRAFT
    error: Exception | None = None  # the proposer failed: its request ends, no other
    seconds: float = 0.0            # this proposer's share of the time spent


def _alone(proposer: Proposer, k: int) -> Proposal:
    t0 = time.perf_counter()
    try:
        return Proposal(proposer.propose(k), None, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported to that request's consumer
        return Proposal(NO_DRAFT, e, time.perf_counter() - t0)


def propose_together(proposers: Sequence[Proposer], ks: Sequence[int]) -> list[Proposal]:
    """The next drafts of several requests: the members of a group in one call of the group, the
    others one by one. A failure stays its own proposer's: after a group's call fails, each of
    its members is asked alone."""
    out: list[Proposal | None] = [None] * len(proposers)
    groups: dict[int, list[int]] = {}
    for i, proposer in enumerate(proposers):
        groups.setdefault(id(proposer) if proposer.group is None else id(proposer.group), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            t0 = time.perf_counter()
            try:
                drafts = proposers[members[0]].group.propose([proposers[i] for i in members],
                                                             [ks[i] for i in members])
            except Exception:  # noqa: BLE001 - whose failure it is shows below, each member alone
                drafts = None
            share = (time.perf_counter() - t0) / len(members)
            if drafts is not None:
                for i, draft in zip(members, drafts, strict=True):
                    out[i] = Proposal(draft, None, share)
                continue
        for i in members:
            out[i] = _alone(proposers[i], ks[i])
    return out  # type: ignore[return-value] - every index is set above


@dataclass(frozen=True)
class SpecConfig:
    method: str = DEFAULT_METHOD  # a registry name; "none" = plain decoding
    k: int = DEFAULT_K            # draft tokens (tree nodes) per step at most
    draft_model: str | None = None  # None: the target's packaged draft, if it has one (LLM.draft_name)
    head: str | None = None       # a trained draft head's directory (None = the head that ships for
                                  # the target, if one does)
    adaptive: bool = True         # verify only the part of a draft expected to pay for itself
    options: Mapping[str, Any] = field(default_factory=dict)  # proposers' own settings by name (as
                                  # their options dataclasses spell them); unset ones keep defaults

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS and self.method != "none":
            raise SpecConfigError(f"unknown proposer {self.method!r}; valid names: "
                                  f"{', '.join(['none', *sorted(PROPOSERS)])}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_K:
            raise SpecConfigError(f"k must be an integer in 0..{MAX_K}, found {self.k!r}")
        unknown = sorted(set(self.options) - set(option_names()))
        if unknown:
            raise SpecConfigError(f"unknown proposer option(s) {', '.join(unknown)}; valid names: "
                                  f"{', '.join(option_names())}")
        if self.method != "none":
            self.proposer_options()  # each options dataclass validates its own values

    def proposer_options(self) -> Any:
        """The method's own options dataclass: the settings it has from `options`, defaults for the rest."""
        kind = registration(self.method).options
        try:
            return kind(**{name: value for name, value in self.options.items() if name in kind.__dataclass_fields__})
        except (TypeError, ValueError) as e:
            raise SpecConfigError(f"proposer {self.method!r}: {e}") from None

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.k > 0

    @property
    def needs_head(self) -> bool:
        """A draft head must load: the proposer cannot do without one, or one is named."""
        if not self.enabled:
            return False
        entry = registration(self.method)
        return entry.loads == "head" and (entry.needs_file or bool(self.head))


class Target(Protocol):
    """What a proposer factory may draw on (quickdraft.api.LLM is one): the target model, and the
    files proposers draft with, each loaded once and checked against the target."""
    model: Transformer
    name: str | None  # the packaged name it was loaded by (None: a path)
    prefix: PrefixCache | None  # the target's prefix cache (None: off), whose budget sizes a draft's

    def draft_model(self, name_or_path: str | None = None) -> Any:
        """A draft model sharing the target's vocabulary (its `.model` and `.tokenizer`); None: the
        packaged one."""

    def draft_head(self, path: str | None = None) -> Any:
        """A DraftHead trained for the target; None: the one that ships for it."""

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """State that proposers share across the requests of this target (a draft model's batched
        cache, tables learned from earlier passes): `make()` on the key's first use, then the same
        object for as long as the target lives."""


@dataclass
class ProposerContext:
    """What a proposer factory may use to start on one request."""
    prompt_ids: list[int]
    params: SamplingParams
    config: SpecConfig
    target: Target

    @property
    def options(self) -> Any:
        """The proposer's own options dataclass (proposers/registry.py)."""
        return self.config.proposer_options()


__all__ = ["DEFAULT_K", "MAX_K", "NO_DRAFT", "PROPOSERS", "Agreement", "Committed", "Draft", "PassCost", "Proposal", "Proposer",
           "ProposerContext", "ProposerGroup", "SpecConfig", "SpecConfigError", "Target", "TopTokens", "propose_together",
           "register"]
