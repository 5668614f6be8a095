"""Issue 45, items 3, 4 and 6: what one hostile client can still do to a connection, over raw sockets
against a live server (uvicorn on 127.0.0.1; a second peer is 127.0.0.2, which Linux routes on lo).

A 413 is answered and its connection closed, a body slower than the minimum rate is cut, one peer
holds at most its share of the connections, a request head past 16 KiB is refused however it is
read, and the interactive docs and the playground's config follow the API key.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from quickdraft.cli import main
from quickdraft.server.connections import MAX_HEADER_BYTES, ConnectionLimits, peer_of
from support.http import KEY, address, answer, closed_within, error_of, status_and_error
from support.server import NAME, PROMPTS, Server, alone

BODY_TIMEOUT_S = 3.0  # short, so that "closed within the body timeout" is quick to check


def head(host: str, path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
    """sendall on a thread (it blocks while the server does not read), ended by a reset or a close."""
    def send() -> None:
        try:
            sock.sendall(data)
        except OSError:
            pass
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


# -- item 3: a 413 closes its connection -------------------------------------------------------------------

def test_a_413_is_answered_with_close_and_closed_within_the_body_timeout(llm) -> None:
    """A declared 3 MiB body (limit 1 MiB): the 413 says Connection: close, and the connection is
    closed once the body is in (sent at once) or at the body timeout (never sent). It stayed open
    for good once the body had come (an idle connection with no timer); a client sending the body at
    once gets the 413 intact (drained, not reset)."""
    s = Server(llm, max_batch=2, connections=ConnectionLimits(body_timeout_s=BODY_TIMEOUT_S))
    host, port = address(s)
    body = b" " * (3 << 20)
    try:
        with socket.create_connection((host, port)) as sent, socket.create_connection((host, port)) as withheld:
            start = time.monotonic()
            sender = send_in_background(sent, head(host, "/v1/chat/completions", len(body)) + body)
            withheld.sendall(head(host, "/v1/chat/completions", len(body)))
            answers = {name: answer(sock, BODY_TIMEOUT_S + 2) for name, sock in (("sent", sent), ("withheld", withheld))}
            sender.join(5)
        for name, (data, _) in answers.items():
            status, headers, error = status_and_error(data)
            assert status == 413 and headers["connection"] == "close", (name, data[:300])
            assert "--max-body-bytes" in error["message"]
        assert answers["sent"][1] < BODY_TIMEOUT_S - 1, answers["sent"][1]  # closed once the body was in
        assert time.monotonic() - start < BODY_TIMEOUT_S + 1.5
        r = httpx.post(f"{s.url}/v1/chat/completions", content=body, timeout=20,
                       headers={"content-type": "application/json"})  # an ordinary client's upload
        assert error_of(r, 413)["message"].startswith("the request body is larger")
        assert r.headers["connection"] == "close"
        assert s.metrics()['quickdraft_rejected_requests_total{status="413"}'] == 3
    finally:
        s.stop()


def test_an_early_answer_leaves_no_idle_connection_behind(llm) -> None:
    """A 401 (given before the body is read) keeps the connection, as HTTP allows; once the body is
    in, the connection idles and is closed by the keep-alive timeout (5 s), not kept for good."""
    s = Server(llm, max_batch=2, api_keys=(KEY,))
    host, port = address(s)
    data = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1}).encode()
    try:
        with socket.create_connection((host, port)) as sock:
            sock.sendall(head(host, "/v1/completions", len(data)))
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 401")
            sock.sendall(data)
            assert closed_within(sock, 8) == b"", "the connection was still open 8 s after its body"
    finally:
        s.stop()


# -- item 4: one peer, and a body slower than the minimum rate ----------------------------------------------

def test_one_peer_holds_at_most_its_share_of_the_connections(llm) -> None:
    """Cap 8, 4 a peer: 8 connections from 127.0.0.1 sending a body a byte at a time: 4 are held,
    4 refused at once (429, Retry-After); a chat from 127.0.0.2 still gets its 200 and its text.
    Without the per-peer cap the 8 took every place and the chat got a 503."""
    limits = ConnectionLimits(max_connections=8, max_connections_per_peer=4, body_timeout_s=30, min_body_rate=0)
    s = Server(llm, max_batch=2, connections=limits)
    host, port = address(s)
    body = json.dumps({"model": NAME, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}).encode()
    held: list[socket.socket] = []
    try:
        refused = []
        for _ in range(8):
            sock = socket.create_connection((host, port))
            sock.sendall(head(host, "/v1/completions", len(body)) + body[:3])
            data = closed_within(sock, 0.3)
            if data is None:
                held.append(sock)  # accepted, its body under way
            else:
                refused.append(data)
                sock.close()
        assert len(held) == 4 and len(refused) == 4, (len(held), len(refused))
        for data in refused:
            status, headers, error = status_and_error(data)
            assert status == 429 and error["code"] == "too_many_connections" and headers["retry-after"] == "1"
            assert "--max-connections-per-peer" in error["message"] and "127.0.0.1" in error["message"]
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)
        r = other.post(f"{s.url}/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        r = other.post(f"{s.url}/v1/completions", json=json.loads(body))
        assert r.json()["choices"][0]["text"] == alone(llm, PROMPTS[2], 8, {"method": "none"})
        other.close()
        for sock in held:  # the slow bodies are served too once whole
            sock.sendall(body[3:])
        for sock in held:
            sock.settimeout(30)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
        s.stop()


@pytest.mark.parametrize(("cap", "per_peer"), [(256, 128), (1000, 500), (20, 16), (12, 12), (1, 1)])
def test_the_default_share_of_a_peer_is_half_the_cap_at_least_16(cap: int, per_peer: int) -> None:
    assert ConnectionLimits(max_connections=cap).per_peer == per_peer
    assert ConnectionLimits(max_connections=cap, max_connections_per_peer=1).per_peer == 1


def test_peers_are_addresses_and_ipv6_slash_64s() -> None:
    assert peer_of(("127.0.0.2", 5)) == "127.0.0.2" and peer_of(("::ffff:10.0.0.1", 5)) == "10.0.0.1"
    assert peer_of(("2001:db8::1", 5)) == peer_of(("2001:db8::ffff:2", 6)) == "2001:db8::/64"
    assert peer_of(("2001:db8:0:1::1", 5)) != peer_of(("2001:db8::1", 5)) and peer_of(None) is None


@pytest.mark.parametrize(("flags", "expected"), [
    (["--max-connections-per-peer", "300"], "max_connections_per_peer must be in 1..max_connections (256), found 300"),
    (["--max-connections-per-peer", "0"], "max_connections_per_peer must be in 1..max_connections (256), found 0"),
    (["--min-body-rate", "-1"], "min_body_rate must be at least 0 bytes/s, found -1")])
def test_the_new_flags_are_checked_before_the_model_loads(flags: list[str], expected: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--model", "/nonexistent", "--no-measure-cost", *flags]) == 1
    assert capsys.readouterr().err == f"quickdraft: error: {expected}\n"


def test_a_body_slower_than_the_minimum_rate_is_cut(llm) -> None:
    """100 bytes/s after a grace of 1 s (body timeout 20 s): a body trickled at ~10 bytes/s is a 408
    within ~1.5 s, its connection closed; one sent at ~300 bytes/s, twice as long, is served."""
    s = Server(llm, max_batch=2, connections=ConnectionLimits(body_timeout_s=20, min_body_rate=100,
                                                               body_rate_grace_s=1.0))
    host, port = address(s)
    fields = json.dumps({"model": NAME, "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0})
    body = (fields[:-1] + " " * (600 - len(fields)) + "}").encode()  # JSON: padded with spaces to 600 bytes

    def trickle(sock: socket.socket, step: int, stop: threading.Event) -> None:
        for i in range(0, len(body), step):
            if stop.wait(0.1):
                return
            try:
                sock.sendall(body[i:i + step])
            except OSError:
                return

    try:
        results = {}
        for name, step in (("slow", 1), ("steady", 30)):
            with socket.create_connection((host, port)) as sock:
                sock.sendall(head(host, "/v1/completions", len(body), "Connection: close\r\n"))
                stop = threading.Event()
                dripper = threading.Thread(target=trickle, args=(sock, step, stop))
                dripper.start()
                try:
                    results[name] = answer(sock, 6)
                finally:
                    stop.set()
                    dripper.join()
        (data, took), (served, _) = results["slow"], results["steady"]
        status, headers, error = status_and_error(data)
        assert status == 408 and error["code"] == "request_timeout" and headers["connection"] == "close", data
        assert "--min-body-rate" in error["message"] and 0.9 < took < 2.5, (error, took)
        assert served.startswith(b"HTTP/1.1 200"), served[:300]
        assert json.loads(served.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == alone(
            llm, PROMPTS[2], 4, {"method": "none"})
        assert s.metrics()['quickdraft_rejected_requests_total{status="408"}'] == 1
    finally:
        s.stop()


# -- item 6: the request head's bound whatever the reads; what the API key guards ---------------------------

def test_a_request_head_past_16_kib_is_refused_even_in_one_read(llm) -> None:
    """A 20 KiB header block in one write: 400 invalid_http, closed (h11 alone checks only a head
    still incomplete, so one read of up to ~70 KB passed). One just under the bound is served."""
    s = Server(llm, max_batch=2)
    host, port = address(s)

    def get(padding: int) -> bytes:
        with socket.create_connection((host, port)) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Pad: {'a' * padding}\r\n"
                         f"Connection: close\r\n\r\n".encode())
            return answer(sock, 5)[0]

    try:
        status, headers, error = status_and_error(get(20 * 1024))
        assert status == 400 and error["code"] == "invalid_http" and headers["connection"] == "close"
        assert str(MAX_HEADER_BYTES) in error["message"]
        fits = get(MAX_HEADER_BYTES - 200)
        assert fits.startswith(b"HTTP/1.1 200"), fits[:200]
    finally:
        s.stop()


def test_the_interactive_docs_need_the_key(llm) -> None:
    """With a key, only /health, /metrics, /openapi.json and the playground's page, files and config
    (read before a key is typed; no more than the schema publishes) are open."""
    s = Server(llm, max_batch=2, api_keys=(KEY,))
    try:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert error_of(httpx.get(f"{s.url}{path}"), 401)["code"] == "invalid_api_key", path
            assert httpx.get(f"{s.url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        for open_path in ("/health", "/metrics", "/openapi.json", "/", "/static/playground.js", "/playground/config"):
            assert httpx.get(f"{s.url}{open_path}").status_code == 200, open_path
        assert error_of(httpx.get(f"{s.url}/no-such-route"), 401)["code"] == "invalid_api_key"
    finally:
        s.stop()
