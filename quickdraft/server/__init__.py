"""The OpenAI-compatible HTTP server: `quickdraft serve` (FastAPI app over one engine thread)."""
from __future__ import annotations

from quickdraft.api import LLM
from quickdraft.engine.policy import StepCost
from quickdraft.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def serve(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, cost: StepCost | None = None, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish for up to
    shutdown_timeout_s, cancel the rest and stop the engine thread."""
    import uvicorn
    uvicorn.run(create_app(llm, config, cost), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=shutdown_timeout_s)
