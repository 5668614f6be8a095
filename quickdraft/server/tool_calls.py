"""A chat reply on its way out (the request's tools come in through requests/shape.py): each choice's
text read (requests/reply.py: harmony's reasoning, the calls) into OpenAI's assistant message, or into
its stream deltas: reasoning_content, content, and a call's id, type and name, then its arguments piece
by piece, as the openai client accumulates them. Knows OpenAI's shapes, not the engine's loop.
"""
from __future__ import annotations

from typing import Any

from quickdraft.requests.reply import Reader, Reply, finish, parsed, read
from quickdraft.structured.conversation import call_id
from quickdraft.structured.tools import Syntax, Tools


class ChatReply:
    """One choice's reply, read as it streams (delta) or whole (rewritten)."""

    def __init__(self, syntax: Syntax, tools: Tools | None, request_id: str) -> None:
        self.syntax, self.tools, self.request_id = syntax, tools, request_id
        self.reader = Reader(syntax, tools)

    def call_id(self, index: int) -> str:
        return call_id(self.request_id, index)

    def delta(self, text: str, finished: bool) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
        """A stream chunk's (content, reasoning_content, tool_calls) from its text; finished: the
        reply's last chunk. Content is null beside reasoning or calls, as OpenAI's deltas leave it."""
        said = self.reader.feed(text, end=finished)
        calls = []
        for piece in said.calls:
            if piece.name is None:
                calls.append({"index": piece.index, "function": {"arguments": piece.arguments}})
            else:
                calls.append({"index": piece.index, "id": self.call_id(piece.index), "type": "function",
                              "function": {"name": piece.name, "arguments": piece.arguments}})
        content = said.content if said.content or not (calls or said.reasoning) else None
        return content, said.reasoning or None, calls or None

    def message(self, reply: Reply) -> dict[str, Any]:
        """The whole reply as OpenAI's assistant message (content null where it is all calls)."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": reply.content or (None if reply.calls else reply.content)}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [{"id": self.call_id(i), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(reply.calls)]
        return message


def reply_of(syntax: Syntax, tools: Tools | None, request_id: str) -> ChatReply | None:
    """A chat choice's reply where it is read for more than its text (None: its text is its content)."""
    return ChatReply(syntax, tools, request_id) if parsed(syntax, tools) else None


def rewritten(choice: dict[str, Any], reply: ChatReply | None) -> dict[str, Any]:
    """A whole response's chat choice (responses.choice) with its text read into content, reasoning
    and calls."""
    if reply is None:
        return choice
    said = read(reply.syntax, reply.tools, choice["message"]["content"])
    return {**choice, "message": reply.message(said), "finish_reason": finish(choice["finish_reason"], said.complete)}


def delta(text: str, finish_reason: str | None, reply: ChatReply | None
          ) -> tuple[str | None, str | None, list[dict[str, Any]] | None, str | None]:
    """A stream chunk's (content, reasoning_content, tool_calls, finish_reason) from its text and the
    engine's reason."""
    if reply is None:
        return text, None, None, finish_reason
    content, reasoning, calls = reply.delta(text, finish_reason is not None)
    return content, reasoning, calls, None if finish_reason is None else finish(finish_reason, reply.reader.complete)
