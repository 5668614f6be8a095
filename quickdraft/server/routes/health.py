"""/health: liveness, and which weights and CPU kernel answer (no silent slow path); /metrics:
Prometheus' text format."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import PlainTextResponse

from quickdraft import kernels
from quickdraft.server.config import ServerConfig
from quickdraft.server.state import served


async def health(http: HTTPRequest) -> dict[str, str]:
    """Liveness, and which weights and CPU kernel answer (no silent slow path)."""
    weights = served(http).llm.model.weight_format
    return {"status": "ok", "weights": weights, "kernel": kernels.kernel_info().isa or "none (torch path)"}


async def prometheus(http: HTTPRequest) -> PlainTextResponse:
    """Prometheus' text format."""
    return PlainTextResponse(served(http).metrics.render(), media_type="text/plain; version=0.0.4")


def install(app: FastAPI, config: ServerConfig) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"], response_class=PlainTextResponse)
