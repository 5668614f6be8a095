"""Anthropic's Messages API on its way out: the chat route's answer (its OpenAI body, or its stream's
chunks) as a Message, or as Anthropic's server-sent events; error answers in Anthropic's envelope,
rewritten as they leave (`AnthropicErrors`) from the OpenAI bodies every layer of the server writes.
Knows OpenAI's and Anthropic's shapes, not the engine.
"""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server.choices import Choice

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "grammar_dead_end": "end_turn"}  # the chat's finish_reason -> Anthropic's stop_reason
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None  # as on the OpenAI routes: the field at fault, and a code; Anthropic's clients ignore both
    code: str | None


class AnthropicErrorBody(BaseModel):
    type: str  # "error"
    error: AnthropicErrorDetail


MESSAGE = {  # the published schema of a whole answer
    "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
    "properties": {"type": {"const": "message"}, "role": {"const": "assistant"},
                   "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                       "type": {"enum": ["thinking", "text", "tool_use"]}}}},
                   "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                   "usage": {"type": "object", "required": ["input_tokens", "output_tokens"]}}}
EVENT = {  # one server-sent event (its event: and data: lines), as OpenAPI 3.2 describes a stream's items
    "type": "object", "required": ["event", "data"], "properties": {
        "event": {"enum": ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                           "message_delta", "message_stop", "error"]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"type": "object", "required": ["type"]}}}}


def error_body(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body's `error` in Anthropic's envelope."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error["message"], "param": error.get("param"),
                                       "code": error.get("code")}}


def usage(chat: dict[str, Any]) -> dict[str, int]:
    """A chat's usage as Anthropic counts it: input_tokens are the prompt's tokens not read from the cache."""
    cached = chat["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat["prompt_tokens"] - cached, "output_tokens": chat["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish_reason]


def matched_stop(choice: Choice, stops: Sequence[str], decode: Callable[[list[int]], str]) -> str | None:
    """The stop sequence that ended the choice's text, or None. Its text ends where the stop sequence
    begins and its tokens with the one that completes it, so their text past the answer's begins with
    it (the shortest, where several begin there)."""
    if choice.finish_reason != "stop" or not stops:
        return None
    rest = decode(choice.ids)[choice.length:]
    return min((stop for stop in stops if rest.startswith(stop)), key=len, default=None)


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def thinking_block(text: str) -> dict[str, Any]:
    """A harmony model's reasoning as Anthropic's thinking block (unsigned: the signature is empty)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(chat: dict[str, Any], stop_sequence: str | None, thinking: bool = True) -> dict[str, Any]:
    """A whole chat completion (its reply read: tool_calls.rewritten) as Anthropic's Message; its
    reasoning a thinking block first, unless not `thinking` (the request's thinking disabled)."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content = [thinking_block(reply["reasoning_content"])] if thinking and reply.get("reasoning_content") else []
    content += [{"type": "text", "text": reply["content"]}] if reply["content"] else []
    content += [{"type": "tool_use", "id": tool_id(call["id"]), "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])} for call in reply.get("tool_calls") or ()]
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content,
            "stop_reason": stop_reason(choice["finish_reason"], stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage(chat["usage"])}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class Events:
    """A chat answer's chunks (responses.chunk) as Anthropic's events: message_start; a content
    block (start, deltas, stop) per run of thinking (unless not `thinking`) or text and per tool call;
    message_delta with the stop reason and the usage; message_stop. message_start's input_tokens are
    the prompt's; message_delta's, the final ones, leave out the tokens read from the prefix cache
    (known once the engine has the prompt)."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, thinking: bool = True) -> None:
        self.message_id, self.model, self.prompt_tokens, self.thinking = message_id, model, prompt_tokens, thinking
        self.index = -1                  # the last block's
        # the open block: "thinking", "text", or its call's index among the chat's calls
        self.open: str | int | None = None
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> str:
        return event("message_start", {"message": {
            "id": f"msg_{self.message_id}", "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})

    def chunk(self, data: dict[str, Any]) -> list[str]:
        choice = data["choices"][0]
        delta, events = choice["delta"], []
        if self.thinking and delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self._begin("thinking", thinking_block(""))
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                events += self._begin("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first piece
                events += self._begin(call["index"], {"type": "tool_use", "id": tool_id(call["id"]),
                                                      "name": call["function"]["name"], "input": {}})
            if call["function"]["arguments"]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        if choice["finish_reason"] is not None:
            self.finish, self.usage = choice["finish_reason"], data["usage"]
        return events

    def end(self, stop_sequence: str | None) -> list[str]:
        assert self.finish is not None and self.usage is not None, "the chat stream ends with its finish_reason"
        return [*self._close(), event("message_delta", {
            "delta": {"stop_reason": stop_reason(self.finish, stop_sequence), "stop_sequence": stop_sequence},
            "usage": usage(self.usage)}), event("message_stop", {})]

    def _begin(self, kind: str | int, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.index, self.open = self.index + 1, kind
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})


async def stream(chunks: AsyncGenerator[dict[str, Any], None], events: Events,
                 stop_sequence: Callable[[], str | None]) -> AsyncIterator[str]:
    """The chat answer's chunks (streaming.chunks) as Anthropic's events; an error ends it with an
    error event. stop_sequence: asked once the answer has ended."""
    try:
        yield events.start()
        async for chunk in chunks:
            if "error" in chunk:
                yield event("error", error_body(500, chunk["error"]))
                return
            for piece in events.chunk(chunk):
                yield piece
        for done in events.end(stop_sequence()):
            yield done
    finally:  # also when the client left: the chunks' own finally cancels the request
        await chunks.aclose()


class AnthropicErrors:
    """Error answers on paths under `prefix` in Anthropic's envelope (error_body), with their status:
    each layer before and in the routes (Host, the API key, the body's size, validation, the routes'
    checks, a full queue) answers with an OpenAI body, rewritten here as it leaves."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until its body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            try:
                body = json.dumps(error_body(start["status"], json.loads(body)["error"])).encode()
            except (ValueError, KeyError, TypeError):
                pass  # not an OpenAI error body (a 499 has none): sent as it is
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        await self.app(scope, receive, rewriting_send)
