"""The choices of one HTTP request (OpenAI's n): each is a request of its own in the engine, with
its own generator (seeded ones seed, seed + 1, ...), text and log-probabilities; they share the
prompt's prefill through the prefix cache. Knows nothing of the engine's loop or of the routes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from quickdraft.api import Chunk
from quickdraft.engine.batch import Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.logprobs import TokenLogprob
from quickdraft.server import responses as out
from quickdraft.server.schemas import ChatCompletionRequest, CompletionRequest

SEEDS = 2**63  # SamplingParams' seeds are below it


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Each choice's seed: distinct, and the first one's the request's (n = 1 draws as before)."""
    return [None if seed is None else (seed + i) % SEEDS for i in range(n)]


def logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The alternatives to report per token (SamplingParams.logprobs), None where none are asked."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


@dataclass
class Choice:
    index: int
    request: Request
    feed_text: Callable[[TokenEvent], Chunk]  # the request's TextAssembler (timed), pieces on if logprobs are asked
    kind: out.Kind
    spell: out.Spell
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each token's text starts in the choice's text
    length: int = 0                                   # characters of text so far
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None  # the text's (a stop string, or the engine's)
    engine_done: bool = False         # the engine has ended the request
    first: bool = True                # no chunk sent yet

    @property
    def asks_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def feed(self, event: TokenEvent) -> Chunk:
        """The event's text; what it adds to the choice's is kept."""
        self.engine_done = self.engine_done or event.finish_reason is not None
        chunk = self.feed_text(event)
        at = self.length
        for piece in chunk.pieces or ():
            self.offsets.append(at)
            at += len(piece)
        self.length += len(chunk.text)
        self.text.append(chunk.text)
        self.ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.stats, self.finish_reason = chunk.stats, chunk.finish_reason
        return chunk

    def chunk_logprobs(self, chunk: Chunk) -> dict[str, Any] | None:
        """The logprobs field of the stream chunk just fed (None if none are asked)."""
        if not self.asks_logprobs:
            return None
        offsets = self.offsets[len(self.offsets) - len(chunk.token_ids):]
        return out.logprobs(self.kind, chunk.token_ids, chunk.logprobs, self.spell, offsets)

    def body(self) -> dict[str, Any]:
        """The choice in a whole (non-streaming) response, once it has finished."""
        logprobs = out.logprobs(self.kind, self.ids, self.logprobs, self.spell, self.offsets) \
            if self.asks_logprobs else None
        return out.choice(self.kind, self.index, "".join(self.text), self.finish_reason or "length", logprobs)
