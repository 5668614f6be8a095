"""Connections: the limits uvicorn's HTTP/1.1 protocol (h11) does not keep, kept by a subclass of it.

uvicorn closes a connection only when it is idle between requests (its keep-alive timeout); one
whose request never finishes, headers or body, stays open for good, and it admits every
connection. This protocol caps the connections open at once and those of one peer (one more gets a
503 or a 429 at once), bounds a request's line and headers however they are read, gives them
`header_timeout_s` and its body `body_timeout_s` and a minimum rate (a 408 past either, the
connection then closed), drains a body still coming after an answer that closes the connection, and
answers a request h11 cannot parse with an OpenAI error body. Knows nothing about the app, which
sees a request whose body ran out of time as a client that left.
"""
from __future__ import annotations

import asyncio
import http
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from quickdraft.server import responses as out

MAX_CONNECTIONS = 256    # open at once; the batch and its queue are 72 requests by default
MIN_PER_PEER = 16        # the default per-peer cap's floor: a browser opens 6 a host, a NAT'd office several browsers
HEADER_TIMEOUT_S = 10.0  # the request line and headers, from the connection's opening or the request's first byte
BODY_TIMEOUT_S = 30.0    # the whole body, from the end of its headers (1 MiB at >= 35 KB/s)
MIN_BODY_RATE = 1024     # bytes/s a body must average from its headers on, once its grace is over
BODY_RATE_GRACE_S = 5.0  # before which a body's rate is not judged (a small body needs only to be whole by then)
RATE_RECHECK_S = 0.25    # the shortest wait between two checks of a body's rate
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (h11's default)
HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request's head, as h11 finds it
ANSWERED = "quickdraft.answered_by_connection"  # scope key: this protocol answered the request itself


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections_per_peer: int | None = None  # None: half of max_connections, at least MIN_PER_PEER (per_peer)
    min_body_rate: int = MIN_BODY_RATE           # bytes/s; 0: none
    body_rate_grace_s: float = BODY_RATE_GRACE_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, found {self.max_connections}")
        per_peer = self.max_connections_per_peer
        if per_peer is not None and not 1 <= per_peer <= self.max_connections:
            raise ValueError(f"max_connections_per_peer must be in 1..max_connections ({self.max_connections}), "
                             f"found {per_peer}")
        if self.min_body_rate < 0:
            raise ValueError(f"min_body_rate must be at least 0 bytes/s, found {self.min_body_rate}")
        for name in ("header_timeout_s", "body_timeout_s", "body_rate_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, found {getattr(self, name)}")

    @property
    def per_peer(self) -> int:
        """The connections one peer may hold: given, or half the cap (at least MIN_PER_PEER, at most the cap),
        so that one peer never holds every place and a peer behind NAT is rarely refused."""
        if self.max_connections_per_peer is not None:
            return self.max_connections_per_peer
        return min(self.max_connections, max(MIN_PER_PEER, self.max_connections // 2))


def peer_of(client: tuple[str, int] | None) -> str | None:
    """Whom a connection is counted against: its IP address; an IPv6 one's /64 (a host usually holds a
    whole /64), an IPv4-mapped one its IPv4 address. None without an address (a Unix socket)."""
    if not client:
        return None
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return client[0]
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


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


class AnswerTransport:
    """The connection as a request's answer sees it (uvicorn's cycle writes and closes through it):
    closing it while the request's body is still coming drains the body first (GuardedH11Protocol.
    close_after_body), so that the client reads the answer rather than a reset for the bytes it sends."""

    def __init__(self, protocol: GuardedH11Protocol) -> None:
        self.protocol = protocol

    def write(self, data: bytes) -> None:
        self.protocol.transport.write(data)

    def is_closing(self) -> bool:
        return self.protocol.draining or self.protocol.transport.is_closing()

    def close(self) -> None:
        self.protocol.close_after_body()


class GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits
    count: Callable[[int], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # h11's header limit: uvicorn's h11_max_incomplete_event_size
        self._timer: asyncio.TimerHandle | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body" while a timer runs
        self._body_bytes, self._body_start = 0, 0.0  # of the body under way: bytes read, when its headers ended
        self._expects_continue = False  # the body's client waits for "100 Continue" before sending it
        self.draining = False  # answered and closing: the rest of the body is read and dropped
        self.peer: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = peer_of(self.client)
        if len(self.connections) > self.limits.max_connections:
            message = (f"the server has {self.limits.max_connections} connections open, its limit "
                       f"(quickdraft serve --max-connections); retry after 1 s")
            self._refuse(raw_error(503, message, "too_many_connections", "server_error", (("retry-after", "1"),)), 503)
            return
        if self.peer is not None and self._peer_connections() > self.limits.per_peer:
            message = (f"this client ({self.peer}) has {self.limits.per_peer} connections open, the most one "
                       f"address may hold (quickdraft serve --max-connections-per-peer); close one or retry after 1 s")
            self._refuse(raw_error(429, message, "too_many_connections", "rate_limit_error",
                                   (("retry-after", "1"),)), 429)
            return
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self.draining:
            self._drain(data)
            return
        if self.conn.their_state is h11.IDLE:
            if self._waiting_for is None:
                self._arm("headers")  # the first bytes of a request after an earlier one on this connection
            if self._head_too_long(data):
                self.send_400_response("")
                return
        elif self._waiting_for == "body":
            self._body_bytes += len(data)
        super().data_received(data)
        self._follow()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not isinstance(self.cycle.transport, AnswerTransport):
            self.cycle.transport = AnswerTransport(self)  # type: ignore[assignment]  # before its task first runs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.draining:
            self._unset_keepalive_if_required()  # bounded by the body's deadline and rate instead
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (uvicorn's own answer is plain text), or its head is too long."""
        message = (f"the request is not valid HTTP/1.1 (its request line, headers or framing), or its request "
                   f"line and headers are longer than {MAX_HEADER_BYTES} bytes")
        self._refuse(raw_error(400, message, "invalid_http"), 400)

    def close_after_body(self) -> None:
        """Close once the request's body is in (read and dropped), or at its deadline or rate, whichever comes
        first; at once if none is coming (none declared, whole already, or held for a "100 Continue")."""
        if self.transport.is_closing() or self.draining:
            return
        if self.conn.their_state is h11.SEND_BODY and not (self._expects_continue and self._body_bytes == 0):
            self.draining = True
            self.flow.resume_reading()
        else:
            self._close()

    # -- what a peer holds, what a request's head and body may be ----------------------------------------

    def _peer_connections(self) -> int:
        return sum(1 for c in self.connections if getattr(c, "peer", None) == self.peer)

    def _head_too_long(self, data: bytes) -> bool:
        """The request's head, buffered and new, past MAX_HEADER_BYTES: h11 checks only a head still
        incomplete, so a longer one arriving in one read (up to ~70 KB) would pass."""
        head = self.conn.trailing_data[0] + data  # no head is whole yet: at most the bound plus one read
        end = HEAD_END.search(head)
        return (end.end() if end else len(head)) > MAX_HEADER_BYTES

    def _drain(self, data: bytes) -> None:
        self._body_bytes += len(data)
        self.conn.receive_data(data)
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                event = h11.ConnectionClosed()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self._close()
                return

    # -- the timers -------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Move the timer along with the request: headers -> body -> none."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._waiting_for == "headers":
            self._arm("body")
        elif state is not h11.SEND_BODY and self._waiting_for == "body":
            self._disarm()
            if state is h11.IDLE and self.timeout_keep_alive_task is None and not self.transport.is_closing():
                # answered before its body ended: idle now, and closed as an idle connection is (the body's
                # bytes cancelled uvicorn's keep-alive timer, set when the answer went out)
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
        elif state is not h11.IDLE and self._waiting_for == "headers":
            self._disarm()  # a request without a body: whole already

    def _arm(self, part: str) -> None:
        self._disarm()
        seconds = self.limits.header_timeout_s if part == "headers" else self.limits.body_timeout_s
        self._waiting_for = part
        self._timer = self.loop.call_later(seconds, self._late, part)
        if part == "body":
            self._body_bytes = len(self.cycle.body) if self.cycle is not None else 0  # came with the headers
            self._body_start = self.loop.time()
            self._expects_continue = self.conn.they_are_waiting_for_100_continue
            if self.limits.min_body_rate and self.limits.body_rate_grace_s < self.limits.body_timeout_s:
                self._rate_timer = self.loop.call_later(self.limits.body_rate_grace_s, self._check_rate)

    def _disarm(self) -> None:
        for timer in (self._timer, self._rate_timer):
            if timer is not None:
                timer.cancel()
        self._timer, self._rate_timer, self._waiting_for = None, None, None

    def _check_rate(self) -> None:
        """Once the grace is over: the body's bytes so far against min_body_rate times its time so far;
        checked again when they would fall short, were no byte more to come."""
        self._rate_timer = None
        if self._waiting_for != "body":
            return
        rate = self.limits.min_body_rate
        if self.flow.read_paused and not self.draining:  # the server stopped reading (its buffer is full):
            self._body_start += RATE_RECHECK_S           # that time is not the client's
            self._rate_timer = self.loop.call_later(RATE_RECHECK_S, self._check_rate)
            return
        elapsed = self.loop.time() - self._body_start
        if self._body_bytes >= rate * elapsed:
            self._rate_timer = self.loop.call_later(max(self._body_bytes / rate - elapsed, RATE_RECHECK_S),
                                                    self._check_rate)
            return
        self._cut("body", f"the request's body came at {self._body_bytes / elapsed:.0f} bytes/s, slower than the "
                          f"{rate} bytes/s this server needs once {self.limits.body_rate_grace_s:g} s have passed "
                          f"(quickdraft serve --min-body-rate)")

    def _late(self, part: str) -> None:
        flag, seconds = (("--header-timeout", self.limits.header_timeout_s) if part == "headers"
                         else ("--body-timeout", self.limits.body_timeout_s))
        self._cut(part, f"the request's {part} did not arrive within {seconds:g} s (quickdraft serve {flag})")

    def _cut(self, part: str, message: str) -> None:
        """The request's `part` came too late or too slowly: a 408 with `message`, and the connection closed."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle if part == "body" else None
        if part == "headers" and not self.conn.trailing_data[0] and self.conn.their_state is h11.IDLE:
            self._close()  # nothing of a request came: closed as an idle keep-alive connection is
            return
        if cycle is not None and cycle.response_started:
            self._close()  # answered already (e.g. a 413 before the body was read); the rest never came
            return
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
        self.draining = False
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()
