"""The engine thread: owns the model, admits and cancels requests between steps, and hands each
step's token events to the request they belong to.

HTTP handlers talk to it only through `submit` and `cancel` (thread-safe); everything else,
building proposers included, runs on the engine's thread. All torch work stays on one thread on
purpose: OpenMP keeps a worker pool per calling thread, and once the pools hold more threads than
the machine has cores, libgomp stops spinning between parallel regions, which made every decode
step about 1.7x slower here. `quickdraft serve` therefore runs the engine on the thread that
loaded the model (`run`); `start` runs it on a thread of its own (tests). The engine ends only
the requests whose own pass fails; should a step fail outside any request's pass (a bug), the
requests it held end with the error and the engine stays ready for the next ones. At shutdown,
`close` ends every request still there with a `ShuttingDown` error, so each client gets a final
answer before the HTTP side stops.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from quickdraft.engine.batch import Engine, Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.server.metrics import Metrics
from quickdraft.proposers.base import Proposer

log = logging.getLogger("quickdraft.server")

Sink = Callable[[TokenEvent], None]  # called on the engine thread; must not block


class ShuttingDown(Exception):
    """The error of requests the server cancelled because its shutdown timeout ran out."""


class EngineWorker:
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = threading.Event()
        self._closed: ShuttingDown | None = None  # set by close(): every request, new ones too, ends with it
        self._thread = threading.Thread(target=self.run, name="quickdraft-engine", daemon=True)

    def start(self) -> None:
        """Run the engine on a thread of its own."""
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left and end the loop (called once the HTTP side has drained)."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def run(self, stop_when: Callable[[], bool] = lambda: False) -> None:
        """Run the engine on the calling thread until stop() or stop_when() (checked twice a second
        when idle)."""
        while not (self._stopping.is_set() or stop_when()):
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
            self.metrics.set_queue(self.engine.num_running, self.engine.num_waiting)
        for request_id in list(self._sinks):
            self.engine.cancel(request_id)
            self._finish(request_id, None, cancelled=True)
        self.metrics.set_queue(0, 0)

    def submit(self, request: Request, sink: Sink, make_proposer: Callable[[], Proposer | None] | None = None) -> None:
        """Queue a request; `make_proposer` builds its proposer on the engine thread (it may allocate
        tensors, e.g. a draft model's cache)."""
        self._inbox.put(("add", (request, sink, make_proposer)))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def close(self, reason: str) -> None:
        """End every request, running, waiting or still to come, with ShuttingDown(reason)."""
        self._inbox.put(("close", ShuttingDown(reason)))

    # -- the engine thread ------------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                self._add(*item)
            elif kind == "cancel" and item in self._sinks:
                self.engine.cancel(item)
                self._finish(item, None, cancelled=True)
            elif kind == "close":
                self._closed = item
                for request_id in list(self._sinks):
                    self._end(request_id, item)
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: Request, sink: Sink, make_proposer: Callable[[], Proposer | None] | None) -> None:
        self._sinks[request.id] = sink
        if self._closed is not None:
            self._end(request.id, self._closed)
            return
        try:
            if make_proposer is not None:
                request.proposer = make_proposer()
            self.engine.add(request)
        except Exception as e:  # noqa: BLE001 - the handler checked; report, never crash
            sink(TokenEvent([], "error", error=e))
            self._finish(request.id, "error")

    def _end(self, request_id: str, error: ShuttingDown) -> None:
        """Cancel a request, telling its client why."""
        stats = next((row.stats for row in self.engine.rows if row.request.id == request_id), GenerationStats())
        self.engine.cancel(request_id)
        self._sinks[request_id](TokenEvent([], "error", stats, error))
        self._finish(request_id, None, cancelled=True)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a broken step must not take the server down
            log.exception("engine step failed outside any request's pass; ending the requests it held")
            for row in list(self.engine.rows):
                self._deliver(row.request.id, TokenEvent([], "error", row.stats, e))
                self.engine.cancel(row.request.id)
            return
        self.metrics.observe_step(time.perf_counter() - start)
        for request_id, event in events:
            self._deliver(request_id, event)

    def _deliver(self, request_id: str, event: TokenEvent) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        if event.error is not None:  # the client sees the message; the operator needs the traceback
            log.error("request %s failed", request_id, exc_info=event.error)
        self.metrics.observe_event(request_id, event)
        sink(event)
        if event.finish_reason is not None:
            self._finish(request_id, event.finish_reason)

    def _finish(self, request_id: str, reason: str | None, cancelled: bool = False) -> None:
        self._sinks.pop(request_id, None)
        self.metrics.finish(request_id, "cancelled" if cancelled else reason or "cancelled")
