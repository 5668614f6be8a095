"""A request and the row it decodes in: what the engine's parts (engine/batch.py, admission.py,
placement.py) read and write of each, and the small per-row functions they share. Knows nothing of
steps or of the order of phases.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import torch

from quickdraft.engine.events import FinishReason, GenerationStats, TokenEvent
from quickdraft.errors import ContextTooLong
from quickdraft.proposers.base import EACH
from quickdraft.spec.draft_contract import NO_DRAFT, Draft, Proposer
from quickdraft.spec.logprobs import TokenLogprob, token_logprobs
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import Constraint

Events = list[tuple[str, TokenEvent]]
log = logging.getLogger("quickdraft.engine")


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    proposer: Proposer | None = None
    k: int = 0                  # draft tokens per step at most (0 = plain decoding)
    adaptive: bool = True       # let the policy verify only the part of a draft that pays off
    constraint: Constraint | None = None  # a grammar the output follows (grammar.py), at every drafted position too
    prompt_logprobs: int | None = None  # score the prompt: its tokens' log-probabilities (after the first)
                                        # and this many alternatives' (None: not scored)
    cache_scope: str = ""       # whose prefix-cache entries it reads and leaves (prefix_cache.py: a client's;
                                # "" the one every request without a scope shares)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(eq=False)  # rows are compared by identity: they hold tensors
class Row:
    request: Request
    budget: int                 # new tokens this row may still produce in all
    stop_ids: frozenset[int]
    generator: torch.Generator
    stats: GenerationStats
    start: float
    length: int = 0             # tokens with K/V in the cache
    last: int = -1              # newest committed token: fed first at the next step
    draft: Draft = NO_DRAFT     # the proposer's offer for the next step
    tokens: list[int] = field(default_factory=list)  # the prompt, then every committed token: the
                                # K/V in the cache are those of tokens[:length]
    features: list[torch.Tensor] = field(default_factory=list)  # [n, F] pieces: the model's
                                # features at tokens[:length] (kept for the prefix cache only)
    scored: list[TokenLogprob] = field(default_factory=list)  # the prompt's log-probabilities so far
                                # (Request.prompt_logprobs), until its first event carries them
    failed: bool = False        # its pass or proposer raised: its K/V are not offered to the prefix cache

    @property
    def pinned(self) -> bool:
        """Seeded sampling reproduces only if this row's draft lengths depend on nothing outside
        it (step times, other rows): such rows verify the whole draft their proposer offers."""
        p = self.request.params
        return not self.request.adaptive or (not p.greedy and p.seed is not None)

    @property
    def draft_budget(self) -> int:
        """Draft tokens the next step may verify: the request's k, less where its budget ends (a
        step commits the accepted drafts and one token of the target's)."""
        return min(self.request.k, self.budget - self.stats.new_tokens - 1)


def check_context(prompt_len: int, context: int, note: str = "") -> None:
    """`note`: why the context ends there, where the model says (ModelConfig.context_note)."""
    if prompt_len == 0:
        raise ContextTooLong("the prompt is empty; expected at least one token")
    if prompt_len >= context:
        raise ContextTooLong(
            f"the prompt has {prompt_len} tokens but the context holds {context}{note}; "
            f"expected at most {context - 1} so at least one token can be generated")


def cut_at_stop(new: list[int], stop_ids: frozenset[int], remaining: int) -> tuple[list[int], FinishReason | None]:
    """The tokens to emit out of a step's `new` ones: a stop token or the budget inside an accepted
    run ends generation there and drops what follows."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[:i], "stop"
        if i + 1 >= remaining:
            return new[:i + 1], "length"
    return new, None


def features_of(row: Row) -> torch.Tensor:
    """The row's features [length, F] (its prompt's, then each step's)."""
    return torch.cat(row.features)[:row.length]


def generated_tokens(row: Row) -> list[int] | None:
    """The tokens the row generated so far, where its penalties count them (None: it has none)."""
    return row.tokens[len(row.request.prompt_ids):] if row.request.params.penalized else None


def step_logprobs(row: Row, logits: torch.Tensor, kept: list[int], tokens: list[int]) -> list[TokenLogprob]:
    """The log-probabilities of a step's committed `tokens` for a row that asks (logprobs.py), from
    the pass's logits [1+W, V] where each was scored: the root's, then each kept node's; else []."""
    top = row.request.params.logprobs
    return [] if top is None else token_logprobs(logits[[0, *(1 + i for i in kept)]], tokens, top)


def grammar_masks(row: Row, n: int) -> torch.Tensor | None:
    """The grammar's allowed tokens [1+n, V] at the row's root and its draft's first n nodes (None: no grammar)."""
    constraint = row.request.constraint
    return None if constraint is None else constraint.masks(n, row.generator.device)


def release_proposer(request: Request) -> None:
    """The request's proposer group lets go of what it holds for it (a draft model's cache row) now,
    wherever the request ends (its last step, a failed prompt, a cancel, an engine closed; a
    proposer that holds nothing yet: a no-op); a group that fails to keeps that memory (logged);
    nothing else ends its state."""
    proposer = request.proposer
    if proposer is not None:
        try:
            (proposer.group or EACH).release([proposer])
        except Exception:  # noqa: BLE001
            log.warning("a proposer group failed to let go of an ended request's state", exc_info=True)
