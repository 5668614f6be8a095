"""The HTTP routes, a module each: `install(app, config)` adds a module's routes to an app whose
`app.state.served` (state.Served) its handlers read, so a module mounts alone on a bare app. Each
route publishes the error statuses it answers (openapi.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from quickdraft.server import openapi
from quickdraft.server.config import ServerConfig


def errors(config: ServerConfig, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error statuses a route answers, 401 among them where the server has an API key."""
    return openapi.errors(*sorted({*statuses, *((401,) if config.api_keys else ())}))


def add_generation(app: FastAPI, path: str, endpoint: Callable[..., Any], config: ServerConfig) -> None:
    """A generation route: it answers JSON or an event stream, or one of these errors. max_body_size:
    FastAPI's own limit, which counts the bytes of a body of no declared length as it streams in."""
    app.add_api_route(path, endpoint, methods=["POST"], max_body_size=config.max_body_bytes,
                      responses={**openapi.GENERATION, **errors(config, 400, 404, 408, 413, 429, 500, 503)})
