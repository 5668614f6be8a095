"""What the engine yields: token events and per-request statistics."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Sequence

from quickdraft.spec.logprobs import TokenLogprob

# error: the request's proposer or pass failed; grammar_dead_end: its grammar (grammar.py) allows no
# token where the text is incomplete
FinishReason = Literal["stop", "length", "error", "grammar_dead_end"]
# Where a committed token came from: a draft token the target accepted (branch: a draft tree's
# node that is not its parent's first child), the target's token after a rejection (recovered),
# after a draft accepted to its end (bonus), or in a pass that verified no draft (target).
OriginKind = Literal["accepted", "branch", "recovered", "bonus", "target"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0    # prompt tokens whose K/V came from the prefix cache (not prefilled)
    new_tokens: int = 0
    ttft_s: float = 0.0       # prompt submitted -> first new token known
    total_s: float = 0.0      # prompt submitted -> last new token known
    target_passes: int = 0    # forward passes of the target model, the prefill included
    committed_tokens: int = 0  # new tokens plus a stop token that ended generation
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)   # per draft depth: nodes verified there
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted there
    propose_s: float = 0.0    # time in the proposer
    verify_s: float = 0.0     # time in target forward passes and verification
    reasoning_tokens: int = 0  # of new_tokens, those of a chat reply's reasoning (harmony's analysis
                               # channel), counted on the way out (requests/text.py), not by the engine

    def snapshot(self) -> GenerationStats:
        """A copy an event can carry while the row's own stats go on counting: its lists copied,
        nothing else to copy (the engine takes one per row every step; deepcopy's generic walk is
        the slow way to the same)."""
        return replace(self, drafted_at=list(self.drafted_at), accepted_at=list(self.accepted_at))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.committed_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.propose_s - self.verify_s)

    def record_draft(self, depths: Sequence[int], accepted: int) -> None:
        """depths: per verified node, its depth (1 = a child of the root; a chain's are 1..n);
        accepted: the length of the accepted path (one node per depth)."""
        missing = max(depths, default=0) - len(self.drafted_at)
        if missing > 0:
            self.drafted_at += [0] * missing
            self.accepted_at += [0] * missing
        for depth in depths:
            self.drafted_at[depth - 1] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.drafted_tokens += len(depths)
        self.accepted_tokens += accepted

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
            "ttft_s": self.ttft_s, "total_s": self.total_s, "tokens_per_s": self.tokens_per_s,
            "target_passes": self.target_passes, "committed_tokens": self.committed_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "tokens_per_pass": self.tokens_per_pass, "acceptance_by_position": self.acceptance_by_position,
            "propose_s": self.propose_s, "verify_s": self.verify_s, "other_s": self.other_s,
            "reasoning_tokens": self.reasoning_tokens,
        }


@dataclass(frozen=True)
class TokenOrigin:
    kind: OriginKind
    depth: int  # the token's position in the draft: 1 = a child of the root; for a recovered or
                # bonus token one past the accepted path; 0 when no draft was verified
    source: str | None = None  # for a draft token, the part of its proposer that drafted it where
                               # the proposer names one (Draft.source: "ngram", "head", "draft")


def token_origins(parents: Sequence[int], kept: Sequence[int], source: str | None = None) -> list[TokenOrigin]:
    """Per token one pass commits: the kept nodes (root to leaf) of the verified draft tree with
    these parents (drafted by `source`), then the target's token (recovered if the last kept node,
    or the root, has children the target rejected; bonus if it is a leaf)."""
    origins = [TokenOrigin("accepted" if parents.index(parents[node]) == node else "branch", depth, source)
               for depth, node in enumerate(kept, 1)]
    if not parents:
        return [*origins, TokenOrigin("target", 0)]
    end = kept[-1] if kept else -1
    return [*origins, TokenOrigin("recovered" if end in parents else "bonus", len(kept) + 1)]


@dataclass
class TokenEvent:
    token_ids: list[int]                     # newly committed tokens (may be empty at the end)
    finish_reason: FinishReason | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: Exception | None = None           # why, when finish_reason is "error"
    origins: list[TokenOrigin] = field(default_factory=list)  # [len(token_ids)] where each came from
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(token_ids)] where the request's
                                                                # params ask for them (logprobs.py)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(prompt) - 1] in a request's
                                # first event where it scores its prompt (Request.prompt_logprobs):
                                # its tokens' after the first, each scored by the positions before it
