"""A chat reply's calls on their way out (the request's tools come in through requests/shape.py): each
choice's text read (tool_reply.Reader) into OpenAI's assistant message, or its stream deltas (a
call's id, type and name, then its arguments piece by piece, as the openai client accumulates them).
Knows OpenAI's shapes, not the engine's loop.
"""
from __future__ import annotations

from typing import Any

from quickdraft.structured.conversation import call_id
from quickdraft.structured.tool_reply import Reader, Reply, calls_of
from quickdraft.structured.tools import Syntax, Tools


class ToolReply:
    """One choice's reply under tools, as it streams (delta) or whole (message)."""

    def __init__(self, tools: Tools, syntax: Syntax, request_id: str) -> None:
        self.tools, self.syntax, self.request_id = tools, syntax, request_id
        self.reader = Reader(tools, syntax)

    def call_id(self, index: int) -> str:
        return call_id(self.request_id, index)

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A stream chunk's (content, tool_calls) from its text; finished: the reply's last chunk."""
        content, pieces = self.reader.feed(text, end=finished)
        calls = []
        for piece in pieces:
            if piece.name is None:
                calls.append({"index": piece.index, "function": {"arguments": piece.arguments}})
            else:
                calls.append({"index": piece.index, "id": self.call_id(piece.index), "type": "function",
                              "function": {"name": piece.name, "arguments": piece.arguments}})
        return (content if content or not calls else None), calls or None

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" where the reply's calls are whole (the grammar then ends it: "stop")."""
        return "tool_calls" if reason == "stop" and self.reader.complete else reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as OpenAI's assistant message (content null where it is all calls)."""
        content, pieces = self.reader.feed(text, end=True)
        calls = Reply(content, calls_of(pieces), self.reader.complete).whole
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else content)}
        if calls:
            message["tool_calls"] = [{"id": self.call_id(i), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(calls)]
        return message


def rewritten(choice: dict[str, Any], reply: ToolReply | None) -> dict[str, Any]:
    """A whole response's chat choice (responses.choice) with its text read into content and calls."""
    if reply is None:
        return choice
    return {**choice, "message": reply.message(choice["message"]["content"]),
            "finish_reason": reply.finish_reason(choice["finish_reason"])}


def delta(text: str, finish_reason: str | None, reply: ToolReply | None
          ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """A stream chunk's (content, tool_calls, finish_reason) from its text and the engine's reason."""
    if reply is None:
        return text, None, finish_reason
    content, calls = reply.delta(text, finish_reason is not None)
    return content, calls, None if finish_reason is None else reply.finish_reason(finish_reason)
