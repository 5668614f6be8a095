"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, an adapter over the chat route.
A request becomes the chat request it is (messages_api.py), which the chat route's own code checks,
renders and tokenizes (routes/chat.py `prepared`) and the engine answers as any chat (streaming.py);
the answer, whole or streamed, is written in Anthropic's shapes, and so are errors (messages_answer.py).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quickdraft.errors import RequestError
from quickdraft.server import messages_answer as answer_of
from quickdraft.server.config import ServerConfig
from quickdraft.server.errors import BadRequest
from quickdraft.server.guards import ANTHROPIC
from quickdraft.server.messages_api import CountTokensRequest, MessagesRequest, chat_request, messages_param
from quickdraft.server.requests import chat_prompt, check_model, shape, tokenized
from quickdraft.server.routes import errors
from quickdraft.server.routes.chat import prepared
from quickdraft.server.state import served
from quickdraft.server.streaming import chunks, completed, submit
from quickdraft.structured.tools import kept_markers


async def messages(body: MessagesRequest, http: HTTPRequest) -> Response:
    arrived = time.perf_counter()
    s = served(http)
    chat = chat_request(body)
    with _named():
        made, params, tools = await prepared(chat, http)
    answer = submit(s, "chat", made, params, arrived, tools, pieces=False)
    first = answer.choices[0]
    # decoded as the text was assembled: a reply's kept markers (harmony's, a tool syntax's) are text too
    decode = functools.partial(s.llm.tokenizer.decode, keep=kept_markers(s.llm.tokenizer, s.prompts.syntax, tools))
    stop_sequence = functools.partial(answer_of.matched_stop, first, params.stop, decode)
    thinking = body.thinking is None or body.thinking.type != "disabled"  # a harmony model's reasoning shown
    if body.stream:
        events = answer_of.Events(first.request.id, answer.model, len(first.request.prompt_ids), thinking)
        return StreamingResponse(answer_of.stream(chunks(answer, include_usage=False), events, stop_sequence),
                                 media_type="text/event-stream")
    reply = await completed(answer, http)
    if not isinstance(reply, dict):
        return reply  # the client left (499), the engine failed (500) or is shutting down (503)
    return JSONResponse(answer_of.message(reply, stop_sequence(), thinking))


async def count_tokens(body: CountTokensRequest, http: HTTPRequest) -> dict[str, int]:
    """The prompt's tokens as /v1/messages renders it, tools included; a place in the queue is held
    while it is tokenized, as for a generation."""
    s = served(http)
    chat = chat_request(body)
    with _named():
        check_model(s, chat)
        tools = shape(chat).tools
        text = await chat_prompt(s.prompts, chat, tools)
        ids = await tokenized(s, text, {}, "messages", http, add_special_tokens=False, n=1)
    return {"input_tokens": len(ids)}


@contextlib.contextmanager
def _named() -> Iterator[None]:
    """The chat's 400s name their field as the Messages request does."""
    try:
        yield
    except RequestError as e:
        e = BadRequest.of(e)
        param = messages_param(e.param)
        message = f"{param}{e.message[len(e.param):]}" if e.param and e.message.startswith(f"{e.param}:") else e.message
        raise BadRequest(e.status, message, param, e.code) from None


def _responses(config: ServerConfig, ok: dict[str, Any], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The route's answers: `ok`'s content, its errors in Anthropic's envelope but a 408, which the
    connection answers before a route is known (OpenAI's, as every route's)."""
    refusals = {status: response if status == 408 else {**response, "model": answer_of.AnthropicErrorBody}
                for status, response in errors(config, *statuses).items()}
    return {200: {"description": "OK", "content": ok}, **refusals}


def install(app: FastAPI, config: ServerConfig) -> None:
    message = {"application/json": {"schema": answer_of.MESSAGE}, "text/event-stream": {"schema": answer_of.EVENT}}
    app.add_api_route(ANTHROPIC, messages, methods=["POST"], max_body_size=config.max_body_bytes,
                      responses=_responses(config, message, 400, 404, 408, 413, 429, 500, 503))
    count = {"application/json": {"schema": {"type": "object", "required": ["input_tokens"],
                                             "properties": {"input_tokens": {"type": "integer", "minimum": 0}}}}}
    app.add_api_route(f"{ANTHROPIC}/count_tokens", count_tokens, methods=["POST"], max_body_size=config.max_body_bytes,
                      responses=_responses(config, count, 400, 404, 408, 413, 429))
