"""The choices of one HTTP request (OpenAI's n, for each prompt of a batch): each is a request of
its own in the engine, with its own generator (seeded ones seed, seed + 1, ...), text and
log-probabilities, starting with its prompt's where it is echoed; they share the prompt's prefill
through the prefix cache. Knows nothing of the engine's loop or of the routes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from quickdraft.engine.batch import Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.requests.text import Chunk
from quickdraft.server import responses as out
from quickdraft.server.schemas import ChatCompletionRequest, CompletionRequest
from quickdraft.spec.logprobs import TokenLogprob

SEEDS = 2**63  # SamplingParams' seeds are below it


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Each choice's seed: distinct, and the first one's the request's (n = 1 draws as before)."""
    return [None if seed is None else (seed + i) % SEEDS for i in range(n)]


def logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The alternatives to report per token (SamplingParams.logprobs), None where none are asked."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def prompt_logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The alternatives to report per prompt token where the prompt is scored (echo with logprobs),
    else None (Request.prompt_logprobs)."""
    return body.logprobs if isinstance(body, CompletionRequest) and body.echo else None


@dataclass(frozen=True)
class Echo:
    """A prompt whose text starts its choices' text (echo): its tokens, their text as they decode, and
    where each token's text starts in it."""
    ids: list[int]
    text: str
    offsets: list[int]

    @classmethod
    def of(cls, ids: list[int], pieces: list[str]) -> Echo:
        """pieces: each token's text (Prompts.pieces)."""
        return cls(ids, "".join(pieces), list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)))


@dataclass
class Choice:
    index: int
    request: Request
    feed_text: Callable[[TokenEvent], Chunk]  # the request's TextAssembler (timed), pieces on if logprobs are asked
    kind: out.Kind
    spell: out.Spell
    echo: Echo | None = None  # the prompt its text starts with (echo)
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # None: an echoed prompt's first token's
    offsets: list[int] = field(default_factory=list)  # where each token's text starts in the choice's text
    length: int = 0                                   # characters of text so far
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None  # the text's (a stop string, or the engine's)
    engine_done: bool = False         # the engine has ended the request
    first: bool = True                # no chunk sent yet

    def __post_init__(self) -> None:
        if self.echo is not None:  # the prompt's logprobs come with the first event (nothing scores its first token)
            self.text, self.length = [self.echo.text], len(self.echo.text)
            self.ids, self.offsets, self.logprobs = list(self.echo.ids), list(self.echo.offsets), [None]

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
        self.logprobs += event.prompt_logprobs  # only an echoed prompt's first event has them
        self.logprobs += chunk.logprobs
        self.stats, self.finish_reason = chunk.stats, chunk.finish_reason
        return chunk

    def chunk_logprobs(self, chunk: Chunk) -> dict[str, Any] | None:
        """The logprobs field of the stream chunk just fed (None if none are asked)."""
        if not self.asks_logprobs:
            return None
        offsets = self.offsets[len(self.offsets) - len(chunk.token_ids):]
        return out.logprobs(self.kind, chunk.token_ids, chunk.logprobs, self.spell, offsets)

    def echo_logprobs(self) -> dict[str, Any] | None:
        """The logprobs field of the stream chunk that echoes the prompt, once the first event is fed
        (None if none are asked)."""
        if not self.asks_logprobs or self.echo is None:
            return None
        n = len(self.echo.ids)
        return out.logprobs(self.kind, self.ids[:n], self.logprobs[:n], self.spell, self.offsets[:n])

    def body(self) -> dict[str, Any]:
        """The choice in a whole (non-streaming) response, once it has finished."""
        logprobs = out.logprobs(self.kind, self.ids, self.logprobs, self.spell, self.offsets) \
            if self.asks_logprobs else None
        return out.choice(self.kind, self.index, "".join(self.text), self.finish_reason or "length", logprobs)
