"""The OpenAI-compatible HTTP server: `quickdraft serve` (FastAPI app over one engine thread)."""
from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from collections.abc import Callable

from quickdraft.api import LLM
from quickdraft.engine.policy import StepCost
from quickdraft.engine.service import loaded_objects_frozen
from quickdraft.errors import QuickdraftError
from quickdraft.server.app import create_app
from quickdraft.server.config import ServerConfig
from quickdraft.server.connections import MAX_HEADER_BYTES, ConnectionLimits, guarded_protocol

__all__ = ["BackgroundServer", "HttpFront", "ServerConfig", "create_app", "listen", "serve"]


SHUTDOWN_GRACE_S = 10.0  # after the shutdown timeout: for the cancelled requests' final answers to go out
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this (uvicorn's default)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), or a QuickdraftError saying why not and which
    flag to change."""
    sock = None
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        if sock is not None:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            why = f"port {port} is already in use on {host} (another server?); choose another with --port"
        elif e.errno == errno.EACCES:
            why = f"port {port} needs privileges this process lacks; choose one above 1023 with --port"
        else:
            why = f"{e.strerror or e}; check --host and --port"
        raise QuickdraftError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


class HttpFront:
    """An ASGI app served by uvicorn on a thread of this process, from a bound socket. stop() shuts
    it down as SIGTERM would: no new connections, in-flight requests get shutdown_timeout_s to
    finish, then `close(reason)` ends the rest with a final answer (a 503 body, or an error event
    and [DONE] for a stream). `count(status)` is told of the errors its connections answer."""

    def __init__(self, app: Callable, connections: ConnectionLimits, count: Callable[[int], None],
                 close: Callable[[str], None], host: str, sock: socket.socket, shutdown_timeout_s: float = 30.0,
                 log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        import uvicorn
        self.app = app
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
        self.shutdown_timeout_s = shutdown_timeout_s
        self._close = close
        # uvicorn's own deadline is only a backstop: its cancellation cuts responses off mid-way. Its h11
        # protocol, with the connection limits it lacks (connections.py); no websockets on this server.
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level=log_level, http=guarded_protocol(connections, count), ws="none",
            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            timeout_graceful_shutdown=shutdown_timeout_s + SHUTDOWN_GRACE_S))
        self._deadline: threading.Timer | None = None
        self.thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def request_stop(self) -> None:
        self._server.should_exit = True
        if self._deadline is None:
            reason = (f"the server is shutting down: this request was still running {self.shutdown_timeout_s:g} s "
                      f"after the shutdown began (--shutdown-timeout) and was cancelled")
            self._deadline = threading.Timer(self.shutdown_timeout_s, self._close, (reason,))
            self._deadline.daemon = True
            self._deadline.start()

    def stop(self) -> None:
        self.request_stop()
        self.thread.join(120)
        self._deadline.cancel()


class BackgroundServer(HttpFront):
    """The app over `llm` served on a free port of `host` (HttpFront says how it stops).

    engine_thread=True also runs the engine on a thread of its own (tests); with False the caller
    runs `self.worker.run(...)` on the thread that loaded the model (serve, bench serve: see
    server/worker.py for why)."""

    def __init__(self, llm: LLM, config: ServerConfig, cost: StepCost | None = None, host: str = "127.0.0.1",
                 port: int = 0, engine_thread: bool = True, shutdown_timeout_s: float = 30.0,
                 log_level: str = "warning", start_timeout_s: float = 60.0, sock: socket.socket | None = None) -> None:
        """sock: already bound to host:port (serve binds before the model loads, to fail early)."""
        sock = sock or listen(host, port)
        try:
            app = create_app(llm, config, cost, engine_thread=engine_thread, bind=host)
        except BaseException:  # refused (the model's engine is another server's): the port is free again
            sock.close()
            raise
        self.worker = app.state.worker
        super().__init__(app, config.connections, app.state.metrics.count_error, self.worker.close, host, sock,
                         shutdown_timeout_s, log_level, start_timeout_s)

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
        with loaded_objects_frozen():
            self.worker.run()
            thread.join()
        self.stop()


def serve(llm: LLM, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, cost: StepCost | None = None, log_level: str = "info",
          sock: socket.socket | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish for up to
    shutdown_timeout_s, cancel the rest and stop the engine. The engine runs on this thread."""
    server = BackgroundServer(llm, config, cost, host, port, engine_thread=False,
                              shutdown_timeout_s=shutdown_timeout_s, log_level=log_level, sock=sock)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    with loaded_objects_frozen():
        server.worker.run(stop_when=lambda: not server.thread.is_alive())
        server.thread.join()
