"""What the engine yields: token events and per-request statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0       # prompt submitted -> first new token known
    total_s: float = 0.0      # prompt submitted -> last new token known
    target_passes: int = 0    # forward passes of the target model, prefill included

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class TokenEvent:
    token_ids: list[int]                     # newly committed tokens (may be empty at the end)
    finish_reason: FinishReason | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
