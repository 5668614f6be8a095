"""The web playground: the page at `/`, its files at `/static/`, and `/playground/config` (the
model served, the server's default speculation, the methods a request may name).

The page talks to the server only through the public API (/v1/chat/completions with stream: true
and its "quickdraft" extension field), so it knows nothing of the engine. These routes are not in
the published API schema, as FastAPI's own /docs is not: they serve a browser, not API clients.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from quickdraft.proposers import MAX_K
from quickdraft.server.config import ServerConfig
from quickdraft.server.requests import methods
from quickdraft.server.state import served

STATIC = Path(__file__).parent.with_name("static")  # server/static, shipped as package data (pyproject.toml)


async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


async def playground_config(http: HTTPRequest) -> dict[str, Any]:
    """The JSON the page reads at start."""
    s = served(http)
    spec = s.config.spec
    return {"model": s.config.model_name, "speculative": {"method": spec.method if spec.enabled else "none",
                                                          "k": spec.k},
            "methods": methods(s), "max_k": MAX_K, "context": s.context}


def install(app: FastAPI, config: ServerConfig) -> None:
    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground/config", playground_config, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
