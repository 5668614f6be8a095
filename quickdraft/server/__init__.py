"""The OpenAI-compatible HTTP server: `quickdraft serve` (FastAPI app over one engine thread)."""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

from quickdraft.api import LLM
from quickdraft.engine.policy import StepCost
from quickdraft.server.app import ServerConfig, create_app

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "serve"]


SHUTDOWN_GRACE_S = 10.0  # after the shutdown timeout: for the cancelled requests' final answers to go out


class BackgroundServer:
    """The app served by uvicorn on a thread of this process, on a free port of `host`.

    engine_thread=True also runs the engine on a thread of its own (tests); with False the caller
    runs `self.worker.run(...)` on the thread that loaded the model (serve, bench serve: see
    server/worker.py for why). stop() shuts the HTTP side down as SIGTERM would: no new
    connections, in-flight requests get shutdown_timeout_s to finish, then the rest are cancelled
    with a final answer (a 503 body, or an error event and [DONE] for a stream)."""

    def __init__(self, llm: LLM, config: ServerConfig, cost: StepCost | None = None, host: str = "127.0.0.1",
                 port: int = 0, engine_thread: bool = True, shutdown_timeout_s: float = 30.0,
                 log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        import uvicorn
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.app = create_app(llm, config, cost, engine_thread=engine_thread, bind=host)
        self.worker = self.app.state.worker
        self.shutdown_timeout_s = shutdown_timeout_s
        # uvicorn's own deadline is only a backstop: its cancellation cuts responses off mid-way
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level,
                                                     timeout_graceful_shutdown=shutdown_timeout_s + SHUTDOWN_GRACE_S))
        self._deadline: threading.Timer | None = None
        self.thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def run_clients(self, clients: Callable[[], None], name: str = "clients") -> None:
        """Run `clients` on a thread of their own against this server (engine_thread=False) while the
        engine runs on the calling thread, the one that loaded the model; then stop both."""
        def run() -> None:
            try:
                clients()
            finally:
                self.worker.stop()

        thread = threading.Thread(target=run, name=name)
        thread.start()
        self.worker.run()
        thread.join()
        self.stop()

    def request_stop(self) -> None:
        self._server.should_exit = True
        if self._deadline is None:
            reason = (f"the server is shutting down: this request was still running {self.shutdown_timeout_s:g} s "
                      f"after the shutdown began (--shutdown-timeout) and was cancelled")
            self._deadline = threading.Timer(self.shutdown_timeout_s, self.worker.close, (reason,))
            self._deadline.daemon = True
            self._deadline.start()

    def stop(self) -> None:
        self.request_stop()
        self.thread.join(120)
        self._deadline.cancel()


def serve(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, cost: StepCost | None = None, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish for up to
    shutdown_timeout_s, cancel the rest and stop the engine. The engine runs on this thread."""
    server = BackgroundServer(llm, config, cost, host, port, engine_thread=False,
                              shutdown_timeout_s=shutdown_timeout_s, log_level=log_level)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    server.worker.run(stop_when=lambda: not server.thread.is_alive())
    server.thread.join()
