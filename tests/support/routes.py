"""The server's parts on their own: route modules on a bare app over a stand-in engine worker
(test_server_routes'), and the cluster's front over fake replicas scripted as ASGI messages (test_cluster's)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI

import quickdraft
from quickdraft.cluster.asgi import HttpCall
from quickdraft.cluster.ingress import REPLICA_HEADER, Ingress
from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.server.app import GENERATION_PATHS
from quickdraft.server.config import ServerConfig
from quickdraft.server.errors import install_error_handlers
from quickdraft.server.guards import Admission
from quickdraft.server.metrics import Metrics
from quickdraft.server.prompts import Prompts
from quickdraft.server.state import Served
from support.server import NAME


class StandInWorker:
    """The engine worker's two doors: each request submitted is recorded and ends at once (no
    token, finish reason length, its prompt counted), as an engine would end a zero budget."""

    def __init__(self, context: int) -> None:
        self.engine = SimpleNamespace(max_seq_len=context)
        self.submitted: list[Request] = []
        self.cancelled: list[str] = []

    def submit(self, request: Request, sink, make_proposer=None) -> None:
        self.submitted.append(request)
        sink(TokenEvent([], "length", GenerationStats(prompt_tokens=len(request.prompt_ids))))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def bare_app(llm: quickdraft.LLM, *routes: Any, context: int = 512, api_keys: tuple[str, ...] = ()) -> FastAPI:
    """Only `routes` (route modules), the error bodies and the queue places, over a stand-in worker."""
    config = ServerConfig(NAME, engine=EngineConfig(max_batch=2), max_waiting=2, api_keys=api_keys)
    served = Served(llm, config, StandInWorker(context), Metrics(llm.prefix), Prompts(llm.tokenizer),
                    ThreadPoolExecutor(1))
    app = FastAPI()
    app.state.served = served
    app.add_middleware(Admission, paths=GENERATION_PATHS, rows=config.engine.max_batch, waiting=config.max_waiting)
    install_error_handlers(app, config.max_body_bytes)
    for module in routes:
        module.install(app, config)
    return app


def start(status: int = 200, sse: bool = False, replica: str = "r1") -> dict[str, Any]:
    kind = b"text/event-stream" if sse else b"application/json"
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", kind), (REPLICA_HEADER.encode(), replica.encode())]}


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


class FakeReplicas:
    """Replicas answering from scripts, one per call: messages, and a ReplicaLost where the replica dies."""

    def __init__(self, scripts: list[list[Any]], reports: list[dict[str, Any]] = (), wanted: int = 2) -> None:
        self.scripts, self._reports, self._wanted = list(scripts), list(reports), wanted
        self.calls: list[tuple[HttpCall, list[int]]] = []

    async def stream(self, call: HttpCall, digests: list[int]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append((call, digests))
        for item in self.scripts.pop(0):
            if isinstance(item, Exception):
                raise item
            yield item

    async def reports(self) -> list[dict[str, Any]]:
        return self._reports

    def wanted(self) -> int:
        return self._wanted


def ask(ingress: Ingress, method: str, path: str, payload: Any = None, content: bytes | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=ingress)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(method, path, json=payload, content=content)
    return asyncio.run(go())


CONTEXT = 4096  # the replicas' context, as the front learns it at start-up
