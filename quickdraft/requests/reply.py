"""A chat reply's text read into what every door answers with: its content, its reasoning and its tool
calls, as it streams (`Reader`) or whole (`read`). On a model whose template speaks harmony, its
channels (structured/harmony.py: the analysis channel is reasoning, calls are messages to functions);
elsewhere, where the request's tools may be called, their calls in the template's syntax
(structured/tool_reply.py); else the text is the content. The Python API and every route read a
chat's reply here. Knows the structured-output layer, not HTTP.
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, replace
from typing import Generator, Iterator

from quickdraft.model.tokenizer import Tokenizer
from quickdraft.requests.text import Chunk
from quickdraft.structured import harmony, tool_reply
from quickdraft.structured.tool_reply import Call, CallPiece
from quickdraft.structured.tools import Syntax, Tools


@dataclass
class Delta:
    content: str
    reasoning: str
    calls: list[CallPiece]  # one piece per call: its name on its first


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str
    calls: list[Call]  # the whole calls: one cut short (the token budget) is never handed on
    complete: bool     # a call was made and every call is whole


def end_ids(tokenizer: Tokenizer, syntax: Syntax) -> frozenset[int]:
    """The tokens that end a generation: the tokenizer's; on a harmony model also its turn's ends
    (harmony.TURN_ENDS: a checkpoint's config.json names <|return|> alone) and never <|end|>."""
    if not syntax.channels:
        return tokenizer.eos_token_ids
    return (tokenizer.eos_token_ids | tokenizer.markers_of(harmony.TURN_ENDS)) - tokenizer.markers_of([harmony.END])


def callable_tools(tools: Tools | None) -> bool:
    return tools is not None and bool(tools.callable())


def read(syntax: Syntax, tools: Tools | None, text: str) -> Reply:
    """A whole chat reply."""
    if syntax.channels:
        said = harmony.read(text, callable_tools(tools))
        return Reply(said.content, said.reasoning, said.whole, said.complete)
    if callable_tools(tools):
        called = tool_reply.read(tools, syntax, text)  # type: ignore[arg-type]
        return Reply(called.content, "", called.whole, called.complete)
    return Reply(text, "", [], False)


def reasoning_counter(syntax: Syntax, tools: Tools | None, chat: bool) -> harmony.ReasoningTokens | None:
    """What counts a reply's reasoning tokens: a chat's on a harmony model, its analysis channel's (None:
    a template without channels has no reasoning, and a prompt's text is not read)."""
    return harmony.ReasoningTokens(callable_tools(tools)) if chat and syntax.channels else None


def parsed(syntax: Syntax, tools: Tools | None) -> bool:
    """Whether a chat reply is read for more than its text (harmony's channels, or calls)."""
    return syntax.channels or callable_tools(tools)


class Reader:
    """A chat reply read as it streams: feed() its text, each call's new content, reasoning and call
    pieces back; only where `parsed` (else the text is the content as it comes)."""

    def __init__(self, syntax: Syntax, tools: Tools | None) -> None:
        assert parsed(syntax, tools), "a reply of text alone needs no reader"
        self.channels = harmony.Reader(callable_tools(tools)) if syntax.channels else None
        self.calls = None if syntax.channels else tool_reply.Reader(tools, syntax)  # type: ignore[arg-type]

    def feed(self, text: str, end: bool = False) -> Delta:
        """What `text` adds; end: the reply is over (nothing is held back)."""
        if self.channels is not None:
            return Delta(*self.channels.feed(text, end))
        content, pieces = self.calls.feed(text, end)  # type: ignore[union-attr]
        return Delta(content, "", pieces)

    @property
    def complete(self) -> bool:
        """A call was made and every call is whole (once the reply is over)."""
        return (self.channels or self.calls).complete  # type: ignore[union-attr]


def finish(reason: str, complete: bool) -> str:
    """"tool_calls" where the reply's calls are whole and it ended of itself ("stop")."""
    return "tool_calls" if reason == "stop" and complete else reason


def read_stream(chunks: Generator[Chunk, None, None], syntax: Syntax, tools: Tools | None, chat: bool) -> Iterator[Chunk]:
    """A generation's chunks, each with what it adds to the reply (its content, reasoning and call
    pieces) as the server's stream deltas read a chat's; a prompt's text is all content. The last
    one's finish reason is "tool_calls" where the reply's calls are whole."""
    reader = Reader(syntax, tools) if chat and parsed(syntax, tools) else None
    with closing(iter(chunks)) as pieces:  # a consumer that stops early ends the request now
        for chunk in pieces:
            if reader is None:
                yield replace(chunk, content=chunk.text)
                continue
            said = reader.feed(chunk.text, end=chunk.finish_reason is not None)
            yield replace(chunk, content=said.content, reasoning=said.reasoning, tool_calls=said.calls,
                          finish_reason=None if chunk.finish_reason is None else
                          finish(chunk.finish_reason, reader.complete))
