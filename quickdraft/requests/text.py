"""The other end of the request pipeline: one request's token events become text chunks, UTF-8-safe
deltas cut at the first stop string, each with the ids, stats, origins and logprobs behind it. The
Python API's `stream`/`generate` and every server answer read a request through it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from quickdraft.engine.events import FinishReason, GenerationStats, TokenEvent, TokenOrigin
from quickdraft.model.tokenizer import StopStringFilter, StreamDetokenizer, Tokenizer
from quickdraft.spec.logprobs import TokenLogprob
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.harmony import ReasoningTokens
from quickdraft.structured.tool_reply import CallPiece


@dataclass
class Chunk:
    """One streamed piece: new text (never half a UTF-8 character) and the ids behind it."""
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | Literal["tool_calls"] | None = None  # tool_calls: LLM.stream's, the calls whole
    stats: GenerationStats = field(default_factory=GenerationStats)
    origins: list[TokenOrigin] = field(default_factory=list)  # [len(token_ids)] where each came from
    pieces: list[str] | None = None  # [len(token_ids)] the text each released (TextAssembler(pieces=True))
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(token_ids)] if params.logprobs is set
    # what the text adds to a chat's reply, where LLM.stream reads it (reply.read_stream; None: not read)
    content: str | None = None  # the answer, outside the reasoning and the calls (a prompt's: all the text)
    reasoning: str = ""         # a harmony reply's analysis channel
    tool_calls: list[CallPiece] = field(default_factory=list)  # the calls' new pieces: a call's name on its first


class TextAssembler:
    """Token events of one request -> text chunks: UTF-8-safe deltas, cut at the first stop string
    (the chunk that finds it says finish_reason "stop"; the consumer then stops the request).

    The ids end with the token that completes the stop string, and the stats count them: a step
    commits several tokens, and those after the stop string's are neither text nor usage.

    pieces: also say which text each token released (they join to the chunk's text; the text the
    detokenizer still held at the end goes to the chunk's last token, or to none if it has none).
    keep: special tokens whose text is kept (a tool syntax's markers: Tokenizer.markers_of).
    reasoning: counts the reply's reasoning tokens into the stats (reply.reasoning_counter), each
    token's text read alone (a header's and a marker's are whole tokens' texts)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, pieces: bool = False,
                 keep: frozenset[int] = frozenset(), reasoning: ReasoningTokens | None = None) -> None:
        self.tokenizer, self.keep, self.reasoning = tokenizer, keep, reasoning
        self.detok = StreamDetokenizer(tokenizer, keep)
        self.stops = StopStringFilter(params.stop)
        # with stop strings, token by token: where one ends is a token; so too for each token's text
        self.by_token = bool(params.stop) or pieces
        self.pieces = pieces

    def feed(self, event: TokenEvent) -> Chunk:
        ids = list(event.token_ids)
        parts, kept, stopped = [], 0, False
        for group in ([t] for t in ids) if self.by_token else [ids]:
            text, stopped = self.stops.feed(self.detok.push(group))
            parts.append(text)
            kept += len(group)
            if stopped:
                break
        if not stopped and event.finish_reason is not None:
            tail, stopped = self.stops.feed(self.detok.flush())
            parts.append(tail + ("" if stopped else self.stops.flush()))
        stats = event.stats
        if kept < len(ids):
            stats = replace(stats, new_tokens=stats.new_tokens - (len(ids) - kept))
        if self.reasoning is not None:
            for token in ids[:kept]:
                self.reasoning.feed(self.tokenizer.decode([token], self.keep))
            stats = replace(stats, reasoning_tokens=self.reasoning.count)
        pieces = None
        if self.pieces:
            pieces = parts[:kept]
            if kept and len(parts) > kept:
                pieces[-1] += parts[kept]
        return Chunk("".join(parts), ids[:kept], "stop" if stopped else event.finish_reason, stats,
                     event.origins[:kept], pieces, event.logprobs[:kept])
