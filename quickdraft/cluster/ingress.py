"""The front of a cluster: one ASGI app that takes every HTTP request, routes it to a replica and
relays the replica's answer; /health and /metrics speak for all replicas.

A generation request's prompt is tokenized here as the replicas' app does (chat template, then
ids, within the replicas' context) to name its block-aligned prefixes (digests.py): the router
(router.py) sends it where they are cached, and the ids go with the call, so the replica renders
and tokenizes nothing again. Everything else, validation, auth, limits and the answer itself, is
the replica's, which runs the unchanged server app (asgi.py), so the API is the same as one process's.

A replica lost mid-request (its process killed, its node gone): if the client has been sent
nothing yet, the request goes to another replica (up to RETRIES times), which, greedy or seeded,
gives the same answer; a stream that has begun ends with an error event and [DONE]; a request no
replica could take gets a 503 with Retry-After. Knows the replicas only through a `Replicas`
backend (the Ray one is in serve.py), so it is tested without Ray.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.types import Message, Receive, Scope, Send

from quickdraft.cluster import REPLICA_HEADER
from quickdraft.cluster.asgi import HttpCall, response_messages
from quickdraft.cluster.digests import prompt_digests
from quickdraft.server import messages_api, responses_api
from quickdraft.server import responses as out
from quickdraft.server.guards import body_too_large
from quickdraft.server.prompts import Prompts
from quickdraft.server.requests import chat_prompt, shape
from quickdraft.server.schemas import ChatCompletionRequest

log = logging.getLogger("quickdraft.cluster")

RETRIES = 2            # other replicas a request that got nothing yet is sent to after its replica is lost
RETRY_AFTER_S = 5      # a replica lost is back within about a model's load
PREFIX = "quickdraft_cluster"


class ReplicaLost(Exception):
    """The replica answering a request stopped (died, restarted, unreachable)."""


class Replicas(Protocol):
    def stream(self, call: HttpCall, digests: list[int]) -> AsyncIterator[Message]:
        """The answer's ASGI messages from the replica the router picks; ReplicaLost if it goes."""

    async def reports(self) -> list[dict[str, Any]]:
        """One report per replica that answered now: {"replica", "metrics" (bytes), "runtime" (dict)}."""

    def wanted(self) -> int:
        """How many replicas the application asks for."""


class Ingress:
    def __init__(self, replicas: Replicas, prompts: Prompts, max_body_bytes: int, context: int) -> None:
        """context: the replicas' (a prompt is tokenized no further than that here, as there)."""
        self.replicas, self.prompts, self.limit, self.context = replicas, prompts, max_body_bytes, context
        self.registry = CollectorRegistry()
        self.routed = Counter(f"{PREFIX}_routed_requests", "Requests sent to each replica (retries included)",
                              ["replica"], registry=self.registry)
        self.lost = Counter(f"{PREFIX}_lost_requests", "Requests whose replica was lost while it answered, by "
                            "outcome (retried, stream_ended, unavailable)", ["outcome"], registry=self.registry)
        self.errors = Counter(f"{PREFIX}_rejected_requests", "Answers with an error status the front gave itself "
                              "(the replicas count theirs), by status", ["status"], registry=self.registry)

    def count_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        if route in (("GET", "/health"), ("HEAD", "/health")):
            await self._health(scope, receive, send)
        elif route == ("GET", "/metrics"):
            await self._metrics(scope, receive, send)
        else:
            await self._forward(scope, receive, send)

    # -- /health, /metrics -------------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Which replicas answer now, out of how many wanted; 503 while none does."""
        reports, wanted = await self.replicas.reports(), self.replicas.wanted()
        status = "ok" if len(reports) >= wanted else "degraded" if reports else "unavailable"
        body = {"status": status, "replicas": {"healthy": len(reports), "wanted": wanted},
                "runtime": {r["replica"]: r["runtime"] for r in reports}}
        response = JSONResponse(body, status_code=503 if not reports else 200,
                                headers={"Retry-After": str(RETRY_AFTER_S)} if not reports else None)
        await response(scope, receive, send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """This front's counters, then every replica's metrics with a `replica` label."""
        text = generate_latest(self.registry) + merge_labelled(
            [(r["replica"], r["metrics"].decode()) for r in await self.replicas.reports()])
        await PlainTextResponse(text, media_type="text/plain; version=0.0.4")(scope, receive, send)

    # -- generation and every other route ----------------------------------------------------------

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive, self.limit)
        if body is None:  # the client left while sending
            return
        if isinstance(body, int):
            self.count_error(413)
            await out.error_response(413, body_too_large(self.limit))(scope, receive, send)
            return
        call = HttpCall.of(scope, body)
        ids, forward = await self._prompt_ids(call)
        if forward:
            call = replace(call, prompt_ids=tuple(ids))
        relay = asyncio.create_task(self._relay(call, prompt_digests(ids), send))
        gone = asyncio.create_task(_disconnected(receive))
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in (relay, gone):
            task.cancel()  # the relay's cancellation closes the replica's answer: its request is cancelled there
        await asyncio.gather(relay, gone, return_exceptions=True)
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()

    async def _relay(self, call: HttpCall, digests: list[int], send: Send) -> None:
        sse = False
        for attempt in range(RETRIES + 1):
            started = False  # whether the client has been sent anything
            head: Message | None = None
            try:
                async for message in self.replicas.stream(call, digests):
                    if message["type"] == "http.response.start":
                        head, sse = message, _is_sse(message)
                        self.routed.labels(replica=_header(message, REPLICA_HEADER)).inc()
                        continue
                    if head is not None:
                        await send(head)
                        head, started = None, True
                    await send(message)
                    if not message.get("more_body", False):
                        return
                return
            except ReplicaLost as e:
                log.warning("a replica was lost answering %s %s (attempt %d): %s", call.method, call.path,
                            attempt + 1, e)
                if started:
                    self.lost.labels(outcome="stream_ended").inc()
                    if sse:
                        stopped = out.error_chunk("the replica running this request stopped; send it again")
                        await send({"type": "http.response.body", "more_body": True, "body": out.sse(stopped).encode()})
                        await send({"type": "http.response.body", "body": out.SSE_DONE.encode(),
                                    "more_body": False})
                    else:
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                self.lost.labels(outcome="retried" if attempt < RETRIES else "unavailable").inc()
        self.count_error(503)
        for message in await response_messages(out.error_response(
                503, f"no replica could answer: the replicas this request went to stopped ({RETRIES + 1} tries); "
                     f"they are restarted, retry after {RETRY_AFTER_S} s", "server_error",
                code="replica_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})):
            await send(message)

    async def _prompt_ids(self, call: HttpCall) -> tuple[list[int], bool]:
        """The prompt's ids as the replica's app would make them, and whether the front made them (a
        chat's, a Messages or Responses request's, a completion's one text prompt: forwarded, the
        replica need not) or the client gave them; none for a request the replica will refuse (it
        says why), that is no generation, or that continues a response the replica stored."""
        try:
            body = json.loads(call.body) if call.method == "POST" else None
            if not isinstance(body, dict):
                return [], False
            chat = _as_chat(call.path, body)
            if chat is not None:  # rendered as the app does, tools included
                text = await chat_prompt(self.prompts, chat, shape(chat).tools)
                return await self.prompts.encode(text, add_special_tokens=False, context=self.context), True
            if call.path == "/v1/completions":
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    return await self.prompts.encode(prompt, add_special_tokens=True, context=self.context), True
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    return prompt, False
        except Exception:  # noqa: BLE001 - a request the replica will refuse: routed by load alone
            return [], False
        return [], False


def _as_chat(path: str, body: dict[str, Any]) -> ChatCompletionRequest | None:
    """The chat request a route answers `body` as (the Messages and Responses routes adapt onto the
    chat route's steps); None for other routes and for a response continuing a stored one (its
    conversation is in the replica's store)."""
    if path == "/v1/chat/completions":
        return ChatCompletionRequest.model_validate(body)
    if path == "/v1/messages":
        return messages_api.chat_request(messages_api.MessagesRequest.model_validate(body))
    if path == "/v1/responses" and body.get("previous_response_id") is None:
        request = responses_api.ResponsesRequest.model_validate(body)
        return responses_api.chat_request(request, request.items())
    return None


def merge_labelled(texts: list[tuple[str, str]]) -> bytes:
    """Prometheus texts of several replicas as one, each sample labelled with its replica."""
    families: dict[str, Any] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            samples = [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                       for s in family.samples]
            if merged is family:
                family.samples = samples
            else:
                merged.samples.extend(samples)

    class Collected:
        def collect(self) -> list[Any]:
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Collected())
    return generate_latest(registry)


async def _read_body(receive: Receive, limit: int) -> bytes | int | None:
    """The whole body; its size so far once past `limit`; None if the client left."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return size
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _header(message: Message, name: str) -> str:
    wanted = name.encode()
    return next((v.decode("latin-1") for k, v in message.get("headers", []) if bytes(k).lower() == wanted), "")


def _is_sse(message: Message) -> bool:
    return _header(message, "content-type").startswith("text/event-stream")
