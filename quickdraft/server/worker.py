"""The server's door to its model's engine service (engine/service.py): its requests, their
metrics, its shutdown, and the loop that drives the engine.

HTTP handlers talk to it only through `submit` and `cancel` (thread-safe); everything else,
building proposers included, runs on the thread driving the engine. All torch work stays on one
thread on purpose: OpenMP keeps a worker pool per calling thread, and once the pools hold more
threads than the machine has cores, libgomp stops spinning between parallel regions, which made
every decode step about 1.7x slower here. `quickdraft serve` therefore drives the engine from the
thread that loaded the model (`run`); `start` drives it from a thread of its own (tests). The
engine ends only the requests whose own pass fails; should a step fail outside any request's pass
(a bug), the requests it held end with the error and the engine stays ready for the next ones. At
shutdown, `close` ends every request of this server still there with a `ShuttingDown` error, so
each client gets a final answer before the HTTP side stops. Other callers of the same model (a
notebook's `llm.generate` beside a background server) share the engine and are not touched.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from quickdraft.engine.batch import Request
from quickdraft.engine.events import TokenEvent
from quickdraft.engine.service import EngineService, MakeProposer, Sink
from quickdraft.server.metrics import Metrics

log = logging.getLogger("quickdraft.server")


class ShuttingDown(Exception):
    """The error of requests the server cancelled because its shutdown timeout ran out."""


class EngineWorker:
    def __init__(self, service: EngineService, metrics: Metrics) -> None:
        self.service = service
        self.engine = service.engine
        self.metrics = metrics
        self._sinks: dict[str, Sink] = {}  # this server's requests in flight
        self._lock = threading.Lock()      # _sinks and _closed: handlers' threads and the driving one
        self._stopping = threading.Event()
        self._attached = False  # counted in service.loops
        self._closed: ShuttingDown | None = None  # set by close(): every request, new ones too, ends with it
        self._thread = threading.Thread(target=self.run, name="quickdraft-engine", daemon=True)

    def start(self) -> None:
        """Drive the engine from a thread of its own."""
        self._attach()  # now: a second server asking for the model's engine must see this one has it
        self._thread.start()

    def _attach(self) -> None:
        if not self._attached:
            self._attached = True
            self.service.loops += 1

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left and end the loop (called once the HTTP side has drained)."""
        self._stopping.set()
        self.service.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def run(self, stop_when: Callable[[], bool] = lambda: False) -> None:
        """Drive the engine on the calling thread until stop() or stop_when() (checked twice a
        second when idle)."""
        self.service.step_observers.append(self.metrics.observe_step)
        self._attach()
        try:
            while not (self._stopping.is_set() or stop_when()):
                self.service.wait(0.5)
                self.service.drive()
                self.metrics.set_queue(self.engine.num_running, self.engine.num_waiting)
            with self._lock:
                left = list(self._sinks)
            for request_id in left:
                self.cancel(request_id)
            self.service.drive(step=False)  # the cancels, now: nothing may hold rows after the server
        finally:
            self.service.loops -= 1
            self._attached = False
            self.service.step_observers.remove(self.metrics.observe_step)
        self.metrics.set_queue(0, 0)

    def submit(self, request: Request, sink: Sink, make_proposer: MakeProposer | None = None) -> None:
        """Queue a request; `make_proposer` builds its proposer on the driving thread."""
        with self._lock:
            closed = self._closed
            if closed is None:
                self._sinks[request.id] = sink
        if closed is not None:
            sink(TokenEvent([], "error", error=closed))
            self.metrics.finish(request.id, "cancelled")
            return
        self.service.submit(request, lambda event: self._deliver(request.id, event), make_proposer)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            mine = self._sinks.pop(request_id, None) is not None
        if mine:
            self.service.cancel(request_id)
            self.metrics.finish(request_id, "cancelled")

    def close(self, reason: str) -> None:
        """End every request of this server, running, waiting or still to come, with ShuttingDown(reason)."""
        with self._lock:
            self._closed = ShuttingDown(reason)
            left = list(self._sinks)
        for request_id in left:
            self.service.end(request_id, self._closed)

    def _deliver(self, request_id: str, event: TokenEvent) -> None:
        """On the driving thread: an event of one of this server's requests."""
        with self._lock:
            sink = self._sinks.get(request_id)
            if sink is not None and event.finish_reason is not None:
                del self._sinks[request_id]
        if sink is None:  # cancelled meanwhile
            return
        if event.error is not None and not isinstance(event.error, ShuttingDown):
            log.error("request %s failed", request_id, exc_info=event.error)  # the client sees the message
        self.metrics.observe_event(request_id, event)
        sink(event)
        if event.finish_reason is not None:
            self.metrics.finish(request_id, "cancelled" if isinstance(event.error, ShuttingDown) else event.finish_reason)
