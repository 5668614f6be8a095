"""`quickdraft bench soak`: a running server under mixed traffic for a while, for what breaks slowly.

`concurrency` clients send, for `duration_s`, a seeded mix of well-formed requests (completions and
chats, streaming or not, greedy, seeded sampling, stop strings), malformed ones (each with the
status it must get), requests whose client leaves mid-answer, bodies past the size limit, and the
hostile clients of issue 35: bodies sent slowly (then whole: served as any other), requests that
stop half-way (headers, body, or a list Content-Length: a 408 within the timeout, or for a
connection that sends nothing, closed), prompts of ~1 MiB (a 400 at once), bursts of idle
connections (each then served), and chat conversations resending their history turn after turn
(a few fixed ones, whose answers are checked, and ones under a system prompt of their own, which
keep the prefix cache evicting). Passes when no answer is a 5xx, every well-formed request gets a
200 and the text it gets alone (asked before the load starts), every bad one its 4xx, no row is
left running, the prefix cache never holds more than its budget, and the server's memory less the
prefix caches' bytes grows less than 5% after a warm-up (the caches fill as the run goes, up to
their budget: memory they are meant to hold, bounded apart).

Knows the server only over HTTP (its /metrics: the prefix caches' bytes); `rss()` reads the memory
of the process that serves. What it sends is soak_traffic.py's, how memory is judged soak_memory.py's,
the verdict soak_report.py's.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from quickdraft.bench.soak_memory import memory_sample
from quickdraft.bench.soak_report import SoakReport
from quickdraft.bench.soak_traffic import SYSTEMS, TURNS, WEIGHTS, malformed_requests, valid_requests

SLACK_S = 2.0  # past a timeout, for the server's answer to arrive on a busy machine
FLOOD = 24     # idle connections opened at once by a "flood"

class Soak:
    def __init__(self, url: str, model: str, rss: Callable[[], int], max_body_bytes: int, seed: int = 0,
                 headers: dict[str, str] | None = None, header_timeout_s: float = 10.0,
                 body_timeout_s: float = 30.0) -> None:
        self.url, self.model, self.rss, self.limit = url, model, rss, max_body_bytes
        self.headers = headers or {}
        self.valid, self.malformed = valid_requests(model), malformed_requests(model)
        self.oversized = json.dumps({"model": model, "prompt": "x" * max_body_bytes}).encode()
        text = "x" * (max_body_bytes - 200)  # fits the body, not the context
        self.huge = [("completions", json.dumps({"model": model, "prompt": text}).encode()),
                     ("chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": text}]
                                                      }).encode())]
        self.timeouts = {"headers": header_timeout_s, "body": body_timeout_s}
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.expected: list[str] = []
        self.conversations: list[list[str]] = []  # per fixed conversation, its answers turn by turn, alone

    def run(self, duration_s: float, concurrency: int, warmup_s: float | None = None,
            progress: Callable[[str], None] | None = None) -> SoakReport:
        report = SoakReport(duration_s, concurrency)
        with httpx.Client(timeout=120, headers=self.headers) as client:
            self.expected = [self._text(client, r, report) for r in self.valid]  # each alone, before the load
            self.conversations = [self._converse(client, system, report) for system in SYSTEMS]
        report.warmup_s = duration_s / 10 if warmup_s is None else warmup_s
        start = time.monotonic()
        deadline = start + duration_s
        threads = [threading.Thread(target=self._client, args=(i, deadline, report)) for i in range(concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            now = time.monotonic() - start
            report.memory.append(memory_sample(now, self.rss, self._metrics))
            if progress:
                m = report.memory[-1]
                progress(f"{now:.0f}/{duration_s:.0f} s, {sum(report.sent.values())} requests, "
                         f"{report.failure_count} failures, RSS {m.rss_mb:.0f} MiB (prefix cache {m.cache_mb:.0f})")
            time.sleep(min(5.0, max(0.5, duration_s / 60)))
        for t in threads:
            t.join()
        report.memory.append(memory_sample(time.monotonic() - start, self.rss, self._metrics))
        report.left_running = self._drained()
        return report

    # -- one client ---------------------------------------------------------------------------------------

    def _client(self, index: int, deadline: float, report: SoakReport) -> None:
        with self.lock:
            rng = random.Random(self.rng.random())
        kinds = list(WEIGHTS)
        first = kinds[index::report.concurrency]  # between them, the clients send every kind first
        with httpx.Client(timeout=120, headers=self.headers) as client:
            while time.monotonic() < deadline:
                kind = first.pop(0) if first else rng.choices(kinds, weights=list(WEIGHTS.values()))[0]
                try:
                    getattr(self, f"_{kind}")(client, rng, report)
                except Exception as e:  # noqa: BLE001 - a transport error is a finding, not a crash
                    self._fail(report, f"{kind}: {type(e).__name__}: {e}")
                with self.lock:
                    report.sent[kind] += 1

    def _valid(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        i = rng.randrange(len(self.valid))
        text = self._text(client, self.valid[i], report)
        if text != self.expected[i]:
            self._fail(report, f"valid request {i}: {text!r} differs from its answer alone {self.expected[i]!r}")

    def _conversation(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """A chat resending its history each turn: one of the fixed ones (each answer as alone), or
        one under a system prompt no other request has (its blocks push others out of the cache)."""
        i = rng.randrange(len(SYSTEMS) + 1)
        if i == len(SYSTEMS):
            self._converse(client, f"Session {rng.random()}: you are a patient teacher. " * 6, report)
            return
        answers = self._converse(client, SYSTEMS[i], report)
        if answers != self.conversations[i]:
            self._fail(report, f"conversation {i}: {answers!r} differ from its answers alone {self.conversations[i]!r}")

    def _converse(self, client: httpx.Client, system: str, report: SoakReport) -> list[str]:
        """The answers to TURNS under `system`, each turn sent with the whole history before it."""
        messages, answers = [{"role": "system", "content": system}], []
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            body = {"model": self.model, "messages": messages, "max_tokens": 16, "temperature": 0}
            answers.append(self._text(client, {"route": "chat/completions", "body": body}, report))
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers

    def _malformed(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        method, route, body, status = rng.choice(self.malformed)
        r = client.request(method, f"{self.url}/v1/{route}", content=body or None,
                           headers={"content-type": "application/json"})
        self._saw(report, r.status_code)
        error = r.json().get("error", {}) if r.headers.get("content-type") == "application/json" else {}
        if r.status_code != status or not error.get("message"):
            self._fail(report, f"{method} {route} {body[:80]!r}: {r.status_code} {r.text[:200]}, expected {status}")

    def _cancelled(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """A stream read up to its first token, or a non-streaming request left after a moment."""
        body = {"model": self.model, "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0.7}
        if rng.random() < 0.5:
            with httpx.stream("POST", f"{self.url}/v1/completions", json={**body, "stream": True},
                              headers=self.headers, timeout=60) as r:
                self._saw(report, r.status_code)
                next(line for line in r.iter_lines() if line.startswith("data: "))
            return  # leaving the block closes the connection mid-stream
        data = json.dumps(body).encode()
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                         f"{auth}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            time.sleep(rng.uniform(0.05, 0.5))

    def _oversized(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        url, headers = f"{self.url}/v1/completions", {"content-type": "application/json"}
        if rng.random() < 0.5:
            r = client.post(url, content=self.oversized, headers=headers)
        else:  # no Content-Length: cut off as it passes the limit
            half = len(self.oversized) // 2
            r = client.post(url, content=iter([self.oversized[:half], self.oversized[half:]]), headers=headers)
        self._saw(report, r.status_code)
        if r.status_code != 413:
            self._fail(report, f"a body of {len(self.oversized)} bytes: {r.status_code} {r.text[:200]}, expected 413")

    def _slow_body(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """A well-formed request whose body comes in two parts, a pause within the body timeout apart:
        served as any other (it holds no place in the queue while it waits)."""
        i = rng.choice([i for i, r in enumerate(self.valid) if not r["body"].get("stream")])
        route, data = self.valid[i]["route"], json.dumps(self.valid[i]["body"]).encode()
        with self._connect() as sock:
            sock.sendall(self._head(route, str(len(data))) + data[:len(data) // 2])
            time.sleep(rng.uniform(0.1, min(1.0, self.timeouts["body"] / 3)))
            sock.sendall(data[len(data) // 2:])
            status, body, _ = _read_answer(sock, 120)
        if status:
            self._saw(report, status)
        if status != 200:
            self._fail(report, f"slow body: {status} {body[:200]!r}, expected 200")
            return
        choice = json.loads(body)["choices"][0]
        text = choice["message"]["content"] if route == "chat/completions" else choice["text"]
        if text != self.expected[i]:
            self._fail(report, f"slow body {i}: {text!r} differs from its answer alone {self.expected[i]!r}")

    def _stalled(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """A request that stops half-way: a 408 once its part's timeout runs out (a connection that
        sent nothing: closed, with no answer)."""
        data = json.dumps({"model": self.model, "prompt": "hi"}).encode()
        head = self._head("completions", str(len(data)))
        part, first = rng.choice([("headers", b""), ("headers", head[:40]), ("body", head + data[:5]),
                                  ("body", self._head("completions", "5, 5") + b"{}")])  # a list length h11 takes as 5
        start = time.monotonic()
        with self._connect() as sock:
            sock.sendall(first)
            status, body, closed = _read_answer(sock, self.timeouts[part] + SLACK_S)
        took = time.monotonic() - start
        if status:
            self._saw(report, status)
        expected = 408 if first else 0
        if status != expected or not closed:
            self._fail(report, f"stalled {part} ({first[-24:]!r}): {status or 'no answer'}, "
                               f"{'closed' if closed else 'still open'} after {took:.1f} s; expected "
                               f"{expected or 'no answer'} and the connection closed within {self.timeouts[part]:g} s")

    def _huge_prompt(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """A prompt of ~1 MiB: a 400 context_length_exceeded at once, from its length alone."""
        route, data = rng.choice(self.huge)
        start = time.monotonic()
        r = client.post(f"{self.url}/v1/{route}", content=data, headers={"content-type": "application/json"})
        took = time.monotonic() - start
        self._saw(report, r.status_code)
        code = r.json().get("error", {}).get("code") if r.status_code == 400 else None
        if code != "context_length_exceeded" or took > SLACK_S:
            self._fail(report, f"a {len(data)}-byte prompt: {r.status_code} {r.text[:200]} after {took:.1f} s, "
                               f"expected 400 context_length_exceeded at once")

    def _flood(self, client: httpx.Client, rng: random.Random, report: SoakReport) -> None:
        """FLOOD connections opened at once and left idle a moment, then each asks /health: all served."""
        socks = [self._connect() for _ in range(FLOOD)]
        try:
            time.sleep(rng.uniform(0.1, 0.5))
            for sock in socks:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {self.host}\r\nConnection: close\r\n\r\n".encode())
            for sock in socks:
                status, body, _ = _read_answer(sock, 60)
                if status:
                    self._saw(report, status)
                if status != 200:
                    self._fail(report, f"flood: /health answered {status or 'nothing'} {body[:200]!r}")
        finally:
            for sock in socks:
                sock.close()

    # -- helpers ------------------------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port))

    def _head(self, route: str, length: str) -> bytes:
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        return (f"POST /v1/{route} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"{auth}Connection: close\r\nContent-Length: {length}\r\n\r\n").encode()

    def _text(self, client: httpx.Client, request: dict[str, Any], report: SoakReport) -> str:
        """The text of a well-formed request ("" and a failure if it did not get a 200)."""
        url, body = f"{self.url}/v1/{request['route']}", request["body"]
        chat = request["route"] == "chat/completions"
        if not body.get("stream"):
            r = client.post(url, json=body)
            self._saw(report, r.status_code)
            if r.status_code != 200:
                self._fail(report, f"valid request: {r.status_code} {r.text[:200]}")
                return ""
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        parts = []
        with client.stream("POST", url, json=body) as r:
            self._saw(report, r.status_code)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self._fail(report, f"valid stream: {event['error']}")
                for choice in event.get("choices", []):
                    parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
        if r.status_code != 200:
            self._fail(report, f"valid stream: {r.status_code}")
        return "".join(parts)

    def _saw(self, report: SoakReport, status: int) -> None:
        with self.lock:
            report.statuses[status] += 1

    def _fail(self, report: SoakReport, what: str) -> None:
        with self.lock:
            report.failure_count += 1
            if len(report.failures) < 50:
                report.failures.append(what)

    def _metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", headers=self.headers).text

    def _drained(self, timeout_s: float = 10.0) -> float:
        """Requests still holding a row once every client is done (cancelled ones are freed at the
        next step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = sum(float(line.split()[1]) for line in self._metrics().splitlines()
                          if line.startswith(("quickdraft_requests_running ", "quickdraft_requests_waiting ")))
            if running == 0 or time.monotonic() > deadline:
                return running
            time.sleep(0.2)


def _read_answer(sock: socket.socket, timeout_s: float) -> tuple[int, bytes, bool]:
    """(status, body, closed) of what the server sends on a connection it should close: status 0
    for no answer; closed False when it was still open after `timeout_s`."""
    sock.settimeout(timeout_s)
    data, closed = b"", True
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        closed = False
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0), body, closed
