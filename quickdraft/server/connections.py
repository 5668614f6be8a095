"""Connections: the limits uvicorn's HTTP/1.1 protocol (h11) does not keep, kept by a subclass of it.

uvicorn closes a connection only when it is idle between requests (its keep-alive timeout); one
whose request never finishes, headers or body, stays open for good, and it admits every
connection. This protocol caps the connections open at once (one more gets a 503 at once), gives
a request's headers `header_timeout_s` from the connection's opening or the request's first byte,
and its body `body_timeout_s` from the end of its headers (a 408 when either runs out, the
connection then closed), and answers a request h11 cannot parse with an OpenAI error body.
Knows nothing about the app, which sees a request whose body ran out of time as a client that left.
"""
from __future__ import annotations

import asyncio
import http
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from quickdraft.server import responses as out

MAX_CONNECTIONS = 256    # open at once; the batch and its queue are 72 requests by default
HEADER_TIMEOUT_S = 10.0  # the request line and headers, from the connection's opening or the request's first byte
BODY_TIMEOUT_S = 30.0    # the whole body, from the end of its headers (1 MiB at >= 35 KB/s)
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (h11's default)
ANSWERED = "quickdraft.answered_by_connection"  # scope key: this protocol answered the request itself


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, found {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, found {getattr(self, name)}")


def raw_error(status: int, message: str, code: str, kind: str = "invalid_request_error",
              headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 error response that closes its connection, written outside h11's state
    machine (the request may be half-read, or not begun)."""
    response = out.error_response(status, message, kind, code=code)
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(response.body)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + bytes(response.body)


def guarded_protocol(limits: ConnectionLimits, count: Callable[[int], None]) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`; `count(status)` is told of each error it answers."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "count": staticmethod(count)})


class GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits
    count: Callable[[int], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # h11's header limit: uvicorn's h11_max_incomplete_event_size
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body" while a timer runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            message = (f"the server has {self.limits.max_connections} connections open, its limit "
                       f"(quickdraft serve --max-connections); retry after 1 s")
            self._refuse(raw_error(503, message, "too_many_connections", "server_error", (("retry-after", "1"),)), 503)
            return
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self._waiting_for is None and self.conn.their_state is h11.IDLE:
            self._arm("headers")  # the first bytes of a request after an earlier one on this connection
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (uvicorn's own answer is plain text)."""
        message = (f"the request is not valid HTTP/1.1 (its request line, headers or framing), or its request "
                   f"line and headers are longer than {MAX_HEADER_BYTES} bytes")
        self._refuse(raw_error(400, message, "invalid_http"), 400)

    # -- the timers -------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Move the timer along with the request: headers -> body -> none."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._waiting_for == "headers":
            self._arm("body")
        elif state is not h11.SEND_BODY and self._waiting_for == "body":
            self._disarm()
        elif state is not h11.IDLE and self._waiting_for == "headers":
            self._disarm()  # a request without a body: whole already

    def _arm(self, part: str) -> None:
        self._disarm()
        seconds = self.limits.header_timeout_s if part == "headers" else self.limits.body_timeout_s
        self._waiting_for = part
        self._timer = self.loop.call_later(seconds, self._late, part)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._waiting_for = None, None

    def _late(self, part: str) -> None:
        self._timer, self._waiting_for = None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if part == "body" else None
        if part == "headers" and not self.conn.trailing_data[0] and self.conn.their_state is h11.IDLE:
            self._close()  # nothing of a request came: closed as an idle keep-alive connection is
            return
        if cycle is not None and cycle.response_started:
            self._close()  # answered already (e.g. a 413 before the body was read); the rest never came
            return
        flag, seconds = (("--header-timeout", self.limits.header_timeout_s) if part == "headers"
                         else ("--body-timeout", self.limits.body_timeout_s))
        message = f"the request's {part} did not arrive within {seconds:g} s (quickdraft serve {flag})"
        if cycle is not None:  # the app waits for the rest of the body: it sees the client leave
            cycle.scope[ANSWERED] = True  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(raw_error(408, message, "request_timeout"), 408)

    def _refuse(self, response: bytes, status: int) -> None:
        self.count(status)
        self.transport.write(response)
        self._close()

    def _close(self) -> None:
        self._disarm()
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()

