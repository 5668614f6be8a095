"""The OpenAI-compatible HTTP server: `quickdraft serve` (FastAPI app over one engine thread)."""
from __future__ import annotations

from quickdraft.api import LLM
from quickdraft.engine.policy import StepCost
from quickdraft.server.app import ServerConfig, create_app

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "serve"]


def serve(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, cost: StepCost | None = None, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish for up to
    shutdown_timeout_s, cancel the rest and stop the engine thread."""
    import uvicorn
    uvicorn.run(create_app(llm, config, cost), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=shutdown_timeout_s)


class BackgroundServer:
    """The app served by uvicorn on a thread of this process, on a free port of `host` (tests and
    `quickdraft bench serve`); stop() shuts it down like SIGTERM would."""

    def __init__(self, llm: LLM, config: ServerConfig, cost: StepCost | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> None:
        import socket
        import threading
        import time

        import uvicorn
        sock = socket.socket()
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.app = create_app(llm, config, cost)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)
