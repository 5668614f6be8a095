"""/v1/chat/completions: a conversation, with tools or a response format, answered by the model's
chat template."""
from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from quickdraft.server.config import ServerConfig
from quickdraft.server.requests import (
    Made,
    cache_scope,
    chat_prompt,
    check_model,
    constraints,
    forwarded_ids,
    prepare,
    shape,
    spec_of,
    tokenized,
)
from quickdraft.server.routes import add_generation
from quickdraft.server.schemas import ChatCompletionRequest
from quickdraft.server.state import served
from quickdraft.server.streaming import respond
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.tools import Tools


async def chat(body: ChatCompletionRequest, http: HTTPRequest) -> Response:
    arrived = time.perf_counter()
    made, params, tools = await prepared(body, http)
    return await respond(served(http), "chat", body, made, params, http, arrived, tools)


async def prepared(body: ChatCompletionRequest, http: HTTPRequest) -> tuple[Made, SamplingParams, Tools | None]:
    """All the chat route does before it answers: the request checked, its prompt rendered and
    tokenized (its places in the queue taken), its engine requests built. /v1/messages answers them
    in Anthropic's shapes."""
    s = served(http)
    check_model(s, body)
    spec = spec_of(s, body)
    shaped = shape(body)  # checked: a 400 naming the field
    constrained = await constraints(s, shaped, body.n)
    # max_completion_tokens wins (OpenAI's newer name); both are checked against the context
    budget = {"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens}
    ids = forwarded_ids(s, budget, http, body.n, "messages")
    if ids is None:
        text = await chat_prompt(s.prompts, body, shaped.tools)
        ids = await tokenized(s, text, budget, "messages", http, add_special_tokens=False, n=body.n)
    made, params = prepare(s, body, spec, constrained, ids, budget, cache_scope(http, body))
    return made, params, shaped.tools


def install(app: FastAPI, config: ServerConfig) -> None:
    add_generation(app, "/v1/chat/completions", chat, config)
