"""ASGI middleware in front of the app: what is refused before a request reaches a route.

Each answers in OpenAI's error shape (responses.error_response); none knows about the engine.
"""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from quickdraft.server import responses as out


def body_too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (quickdraft serve --max-body-bytes)"


class DeclaredBodyLimit:
    """A 413 for a Content-Length past the limit, before a byte of the body is read. Bodies without
    one are counted as they stream in by FastAPI's per-route max_body_size (whose own answer to a
    declared length is plain text, hence this)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length", "")
            if length.isdigit() and int(length) > self.limit:
                await out.error_response(413, body_too_large(self.limit))(scope, receive, send)
                return
        await self.app(scope, receive, send)
