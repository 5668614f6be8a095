"""The contract between proposers and the engine: what a proposer hands in (`Draft`), what it is
told back (`Committed`, with `PassCost`), and the two protocols (`Proposer`, `ProposerGroup`): the
engine speaks only to groups, in batches; a request's proposer holds its own state and names its
group (a draft model's Drafter, or proposers/base.py's EACH for one that drafts alone).

Imports neither the model nor the kernels: verify.py, the engine and a proposer's tests read
these types without loading either.

Terms (as in verify.py and vLLM's rejection sampler):
    p       the target's distribution at a position (after the request's sampling settings)
    q       the proposer's distribution a draft token was drawn from; None: deterministic (one-hot)
    root    the newest committed token: the target scores its successor first
    node    one proposed token; a draft is a tree of nodes, parents before children, a chain being
            the tree whose node i hangs under node i - 1
    accepted   a draft node the verifier keeps; recovered: the target's token drawn after a
            rejection; bonus: the target's token after an accepted leaf
Shapes:
    n       nodes of one draft (n <= k <= MAX_K)
    V       vocabulary size
    F       the target's feature width (Committed.features: its hidden size per feature layer)
    m       positions a step scored for a row: the fed token, then every verified node
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch

T = TypeVar("T")

MAX_K = 32  # verifying more than this many tokens per pass costs more than it can win here


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
    scored_whole: bool = False  # the target scores every verified node's position, not only as far
                                # as the walk reaches (engine/scores.py): its proposer reads the
                                # target's top tokens at each of them, rejected ones too (Committed.top)

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
                     None if self.parents is None else self.parents[:n], self.source, self.scored_whole)


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
    features: torch.Tensor  # [n, F] the target's features (Transformer.feature_layers) at the positions the step ran and
                            # kept: the whole prompt after the prefill, then the fed token and the
                            # accepted drafts (draft heads read them; others ignore them)
    top: Callable[[int], list[list[int]]] | None = None  # top(n): [m][n] the target's n likeliest next
                            # tokens (likeliest first) at each of the m positions the step scored: the
                            # fed token, then every verified draft node in node order, rejected ones
                            # included (after the prefill: the prompt's last token); None: not kept
    cost: PassCost | None = None  # what verifying costs the pass the next draft goes to, for the rows it
                            # will have (set when the proposer is asked); None: the draft's length must
                            # not depend on timing (the engine verifies whole drafts for this request)


class Proposer(Protocol):
    group: ProposerGroup  # who the engine asks for this proposer's drafts, with every other member of
                          # the group at once: its draft model's Drafter (one forward per draft step
                          # for all of them), or EACH (proposers/base.py) for one that drafts alone

    def propose(self, k: int) -> Draft:
        """A tree of at most k nodes that may follow the committed sequence."""

    def commit(self, step: Committed) -> None:
        """The engine appended step.tokens to the sequence (after the prefill: the first token)."""


class ProposerGroup(Protocol):
    """The protocol the engine uses: each step, for the rows whose proposers are members of this
    group (members[i] a proposer whose `group` is this one, each at most once, in row order),
    `commit` then `propose`. Failures stay their members': a member whose commit fails is not
    asked to propose, and its request ends, no other."""

    def commit(self, members: Sequence[Any], steps: Sequence[Committed]) -> list[Exception | None]:
        """What members[i].commit(steps[i]) does, for every member at once. -> [len(members)] the
        exception each member's commit raised (None: it took its step)."""

    def propose(self, members: Sequence[Any], budgets: Sequence[int]) -> list[Draft | Exception]:
        """What members[i].propose(budgets[i]) gives, for every member at once. -> [len(members)]
        each member's draft of at most budgets[i] nodes, or the exception asking it raised.

        Either call raises only where it left every member as it was (a draft model's generators
        rewound): each member is then called alone (a call of one member), so whose failure it
        was shows, and ends only that member's request."""

    def release(self, members: Sequence[Any]) -> None:
        """The members' requests ended (their rows are freed): what the group holds for them (a
        draft model's cache row) is let go now, not when the members become garbage."""


def attempt(call: Callable[[], T]) -> T | Exception:
    """What call() returns, or the exception it raised: a group's call keeps each member's failure
    its own."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the member's request ends with it
        return e
