"""ASGI middleware in front of the app: what is refused before a request reaches a route.

Each answers in OpenAI's error shape (responses.error_response); none knows about the engine.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server import responses as out
from quickdraft.server.connections import ANSWERED


def body_too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (quickdraft serve --max-body-bytes)"


class DeclaredBodyLimit:
    """A 413 for a Content-Length past the limit, before a byte of the body is read, with `Connection:
    close`: the connection then drains what of the body still comes and closes (connections.py), so
    the client reads the 413 and its connection is not left open. Bodies without one are counted as
    they stream in by FastAPI's per-route max_body_size (whose own answer to a declared length is plain
    text, hence this)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length", "")
            if length.isdigit() and int(length) > self.limit:
                await out.error_response(413, body_too_large(self.limit),
                                         headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def answered_hosts(bind: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind` answers (None: any). Bound to loopback, only loopback
    names and `extra`: a web page that rebinds its own name to 127.0.0.1 then cannot read this
    server. Bound elsewhere, `extra` if given."""
    if bind in LOOPBACK or bind.startswith("127."):
        return (*LOOPBACK, bind, *extra) if bind not in LOOPBACK else (*LOOPBACK, *extra)
    return extra or None


def host_name(header: str) -> str:
    """'[::1]:8000' -> '::1', 'localhost:8000' -> 'localhost'."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """A 400 for a Host header not in `allowed` (DNS rebinding). A request with no Host header (HTTP/1.0)
    passes: a browser always sends one."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {name.lower() for name in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host")
            if header is not None and host_name(header.lower()) not in self.allowed:
                message = (f"the Host header {header[:100]!r} is not a name of this server: it answers "
                           f"{', '.join(sorted(self.allowed))} (quickdraft serve --allowed-host NAME adds one)")
                await out.error_response(400, message, param="Host", code="invalid_host")(scope, receive, send)
                return
        await self.app(scope, receive, send)


ANTHROPIC = "/v1/messages"  # Anthropic's routes: its clients send the key as x-api-key, get errors in its envelope
# Open with keys: health and metrics for probes, the schema as OpenAI's is, the playground's page and files
# (package data, nothing of this server: a browser loads them without a header) and its config (the model's
# name, methods and context: what the schema publishes too; the page reads it before a key is typed).
# All else needs a key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/", "/playground/config"})
OPEN_PREFIX = "/static/"


def open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIX)


class ApiKey:
    """Every route but the open ones (open_path) needs `Authorization: Bearer <key>` (Anthropic's also take
    `x-api-key: <key>`) with one of the server's keys: the /v1 routes, the interactive docs, the playground's
    config, unknown paths. Each key is a tenant: the request's scope gets its name under TENANT (a digest
    of the key), its prefix-cache scope (requests.cache_scope)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), hashlib.sha256(key.encode()).hexdigest()[:32]) for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not open_path(scope["path"]):
            headers = Headers(scope=scope)
            given = [headers.get("authorization", "")]
            anthropic = scope["path"].startswith(ANTHROPIC)
            if anthropic:
                given.append(f"Bearer {headers['x-api-key']}" if "x-api-key" in headers else "")
            # in constant time, every pair compared: no guessing by timing
            tenants = [tenant for key in given for expected, tenant in self.expected
                       if hmac.compare_digest(key.encode(), expected)]
            if not tenants:
                header = "Authorization: Bearer <key>" + (" or x-api-key: <key>" if anthropic else "")
                message = (f"no API key given: send the header {header} (quickdraft serve --api-key)"
                           if not any(given) else "the API key given is not this server's")
                response = out.error_response(401, message, code="invalid_api_key",
                                              headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope[TENANT] = tenants[0]
        await self.app(scope, receive, send)


ADMIT = "quickdraft.admit"  # scope key: the route's call to take a place in the queue
TENANT = "quickdraft.tenant"  # scope key: the API key's tenant (ApiKey), absent without keys


class QueueFull(Exception):
    """The route's request found no place; answered with a 429 (errors.py)."""

    def __init__(self, rows: int, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the server is full: {rows} requests decoding and {waiting} waiting (quickdraft serve "
                         f"--max-batch, --max-waiting); retry after {retry_after_s} s")
        self.retry_after = str(retry_after_s)

    def response(self) -> JSONResponse:
        return out.error_response(429, str(self), "rate_limit_error", code="queue_full",
                                  headers={"Retry-After": self.retry_after})


class Admission:
    """At most `rows + waiting` generation requests in the server at once. A request takes its
    place only when its route calls `scope[ADMIT](n)`, once its whole body has arrived and passed
    every check (a slow or refused body holds none); one asking for n choices takes n places, as n
    requests would; past the limit that call raises QueueFull. The places are held until the
    answer is sent or the client is gone."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], rows: int, waiting: int, retry_after_s: int = 1) -> None:
        self.app, self.paths, self.rows, self.waiting = app, paths, rows, waiting
        self.retry_after_s = retry_after_s
        self.inside = 0  # only touched on the event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        held = 0

        def admit(n: int = 1) -> None:
            nonlocal held
            if held:
                return
            if self.inside + n > self.rows + self.waiting:
                raise QueueFull(self.rows, self.waiting, self.retry_after_s)
            self.inside += n
            held = n

        scope[ADMIT] = admit
        try:
            await self.app(scope, receive, send)
        finally:
            self.inside -= held


class CountErrors:
    """Counts every answer with an error status (4xx, 5xx), whichever layer sent it."""

    def __init__(self, app: ASGIApp, count: Callable[[int], None]) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if (message["type"] == "http.response.start" and message["status"] >= 400
                    and not scope.get(ANSWERED)):  # the connection's own 408 is counted where it is sent
                self.count(message["status"])
            await send(message)
        await self.app(scope, receive, counting_send)
