"""/v1/completions: a prompt given as text or as token ids, or a batch of them, continued (OpenAI's
legacy completions); with echo, each choice starts with its prompt, whose tokens are scored where
logprobs are asked (docs/server.md, "Prompt scoring")."""
from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from quickdraft.server.choices import Echo
from quickdraft.server.config import ServerConfig
from quickdraft.server.requests import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    cache_scope,
    check_model,
    constraints,
    forwarded_ids,
    given_ids,
    prepare,
    shape,
    spec_of,
    tokenized,
)
from quickdraft.server.routes import add_generation
from quickdraft.server.schemas import CompletionRequest
from quickdraft.server.state import served
from quickdraft.server.streaming import respond


async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
    arrived = time.perf_counter()
    s = served(http)
    prompts = body.prompts()
    check_model(s, body, len(prompts))
    spec = spec_of(s, body)
    budget = {"max_tokens": COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens}
    places = len(prompts) * body.n  # taken at the first prompt's admission, for all
    shaped = shape(body)
    made, echoes = [], []
    for prompt in prompts:  # prompt i's choices are i * n ... i * n + n - 1, as OpenAI counts them
        constrained = await constraints(s, shaped, body.n)
        if isinstance(prompt, str):
            ids = forwarded_ids(s, budget, http, places, "prompt") or \
                await tokenized(s, prompt, budget, "prompt", http, add_special_tokens=True, n=places)
        else:
            ids = given_ids(s, prompt, budget, http, places)
        choices, params = prepare(s, body, spec, constrained, ids, budget, cache_scope(http, body))
        made += choices
        echoes += [Echo.of(ids, await s.prompts.pieces(ids)) if body.echo else None] * body.n
    return await respond(s, "completion", body, made, params, http, arrived, echoes=echoes)


def install(app: FastAPI, config: ServerConfig) -> None:
    add_generation(app, "/v1/completions", completions, config)
