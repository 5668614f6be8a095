"""An HTTP request carried to a replica and answered there by the server's own app, in process.

The ingress reads a request whole (`HttpCall`), a replica runs it through the unchanged server app
(every route, auth, limit and metric of `quickdraft serve`) and hands back the ASGI messages the
app sends, as it sends them (`call_app`), so a stream streams. The prompt's ids the front made ride
in the call's scope (server/requests.py `PROMPT_IDS`), not in a header: no client can set them. Closing that iterator early is the
client leaving: the app hears `http.disconnect` and cancels its request, as it would under uvicorn.
Knows ASGI; nothing of Ray or of the engine.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Scope

from quickdraft.server import responses as out
from quickdraft.server.requests import PROMPT_IDS

_running: set[asyncio.Task] = set()  # apps still answering a client that left (the loop keeps tasks weakly)


@dataclass(frozen=True)
class HttpCall:
    """What a replica needs of a request: its line, headers, whole body and peer; and the prompt's
    ids where the front rendered and tokenized them (a chat, a completion's one text prompt)."""
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int | None] | None = None
    server: tuple[str, int | None] | None = None
    prompt_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, scope: Scope, body: bytes) -> HttpCall:
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), tuple(scope["headers"]), body,
                   _pair(scope.get("client")), _pair(scope.get("server")))

    def scope(self) -> dict[str, Any]:
        # spec 2.3: Starlette then listens for the disconnect while it streams (2.4 would wait for a failed send)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "root_path": "", "query_string": self.query, "headers": [list(h) for h in self.headers],
                 "client": self.client, "server": self.server, "state": {}}
        if self.prompt_ids is not None:
            scope[PROMPT_IDS] = self.prompt_ids
        return scope


def _pair(address: Any) -> tuple[str, int | None] | None:
    return (str(address[0]), address[1]) if address else None  # (host, port), or (unix socket path, None)


async def call_app(app: ASGIApp, call: HttpCall) -> AsyncIterator[Message]:
    """The messages `app` sends in answer to `call`, up to the last body message. An app that ends
    without a whole answer (a bug) gets a 500 in OpenAI's shape appended."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    pending = [{"type": "http.request", "body": call.body, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.create_task(app(call.scope(), receive, send))
    _running.add(task)
    task.add_done_callback(lambda t: (_running.discard(t), messages.put_nowait(None)))
    started = False
    try:
        while (message := await messages.get()) is not None:
            started |= message["type"] == "http.response.start"
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
        if not started:
            for message in await response_messages(out.error_response(
                    500, "the server's app ended without an answer", "server_error")):
                yield message
        else:
            yield {"type": "http.response.body", "body": b"", "more_body": False}
    finally:
        gone.set()  # the client left, or the answer is whole: either way nothing more is read


async def response_messages(response: ASGIApp) -> list[Message]:
    """The messages a Starlette response sends (to relay one built here)."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await response({"type": "http", "method": "GET", "headers": []}, receive, send)
    return sent
