"""The web playground: the page at `/`, its files at `/static/`, and `/playground/config` (the
model served, the server's default speculation, the methods a request may name).

The page talks to the server only through the public API (/v1/chat/completions with stream: true
and its "quickdraft" extension field), so it knows nothing of the engine. These routes are not in
the published API schema, as FastAPI's own /docs is not: they serve a browser, not API clients.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")  # shipped as package data (pyproject.toml)


def install_playground(app: FastAPI, config: Callable[[], dict[str, Any]]) -> None:
    """config(): the JSON the page reads at start."""
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/playground/config", include_in_schema=False)
    async def playground_config() -> dict[str, Any]:
        return config()

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
