"""/v1/completions: a prompt given as text or as token ids, continued (OpenAI's legacy completions)."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from quickdraft.server.config import ServerConfig
from quickdraft.server.requests import (COMPLETION_DEFAULT_MAX_TOKENS, check_model, constraints, given_ids,
                                        prepare, spec_of, tokenized)
from quickdraft.server.routes import add_generation
from quickdraft.server.schemas import CompletionRequest
from quickdraft.server.state import served
from quickdraft.server.streaming import respond


async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
    arrived = time.perf_counter()
    s = served(http)
    check_model(s, body)
    spec = spec_of(s, body)
    constrained = await constraints(s, body)
    budget = {"max_tokens": body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS}
    if isinstance(body.prompt, str):
        ids = await tokenized(s, body.prompt, budget, "prompt", http, add_special_tokens=True, n=body.n)
    else:
        ids = given_ids(s, body.prompt, budget, http, body.n)
    made, params = prepare(s, body, spec, constrained, ids, budget)
    return await respond(s, "completion", body, made, params, http, arrived)


def install(app: FastAPI, config: ServerConfig) -> None:
    add_generation(app, "/v1/completions", completions, config)
