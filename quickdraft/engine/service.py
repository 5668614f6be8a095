"""One engine per loaded model, shared by every front door: `LLM.stream`, the server, benchmarks.

Callers on any thread `submit` requests (and `cancel` them) through an inbox; one thread at a time
drives the engine: takes the inbox in, runs one step, hands each event to its request's sink. A
server's loop drives from the thread that loaded the model (server/worker.py says why all torch
work should stay there); where nothing else drives, a caller waiting for its own events drives
(`stream`), so a notebook's `llm.generate` needs no thread of its own, and two threads generating
at once share one batch instead of running two engines.

Knows the engine's step and nothing of HTTP, text or metrics (observers get each step's time).
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from quickdraft.engine.batch import Engine, Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.engine.rows import release_proposer
from quickdraft.spec.draft_contract import Proposer

log = logging.getLogger("quickdraft.engine")

Sink = Callable[[TokenEvent], None]  # called on the driving thread; must not block
MakeProposer = Callable[[], "Proposer | None"]
POLL_S = 0.05  # a caller waiting on another thread's driving looks again this often (that thread may stop)


@contextmanager
def loaded_objects_frozen() -> Iterator[None]:
    """For a process that serves from here on (a server's loop, a replica, a latency benchmark).

    Python's full collection scans every object the process holds: with a model, its tokenizer and
    the server's modules loaded, ~300,000 objects, 160-190 ms a pass (the 1.5B on 2 cores, measured
    with gc.collect), and it runs whenever a quarter as many objects again have outlived the younger
    collections (a server's cached prefixes, requests, metrics): a pause of 2-3 engine steps in
    every running stream. What exists once the model is loaded lives as long as the process: frozen
    (gc.freeze), later passes scan only newer objects, and the frozen are still freed by reference
    counting. Undone on the way out (a process that goes on, a test run say, gets its collector
    back whole)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class EngineService:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step_observers: list[Callable[[float], None]] = []  # told each step's seconds (server metrics)
        self.loops = 0  # servers' loops driving it now: while one runs, the engine is theirs to set up
        self._inbox: deque[tuple[str, object]] = deque()
        self._ready = threading.Condition()  # the inbox got something
        self._drive = threading.Lock()       # held by the thread driving the engine
        self._sinks: dict[str, Sink] = {}    # touched only while driving

    # -- any thread ------------------------------------------------------------------------------

    def submit(self, request: Request, sink: Sink, make_proposer: MakeProposer | None = None) -> None:
        """Queue a request; `make_proposer` builds its proposer on the driving thread (it may allocate
        tensors, e.g. a draft model's cache). Every outcome, a refusal included, reaches `sink` as
        events, the last with a finish reason."""
        self._post("add", (request, sink, make_proposer))

    def cancel(self, request_id: str) -> None:
        """Drop a request (its row is freed, its K/V left to the prefix cache); its sink hears no more."""
        self._post("cancel", request_id)

    def end(self, request_id: str, error: Exception) -> None:
        """Cancel a request, telling its sink why (an error event)."""
        self._post("end", (request_id, error))

    def busy(self) -> bool:
        return bool(self._inbox) or self.engine.has_work()

    def wait(self, timeout: float) -> None:
        """Until something is submitted or cancelled, or `timeout` seconds (returns at once while the
        engine has work)."""
        with self._ready:
            if not self.busy():
                self._ready.wait(timeout)

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def drive(self, blocking: bool = True, step: bool = True) -> bool:
        """One turn at the wheel: take the inbox in and, if `step`, run one engine step. Returns
        False, doing nothing, when another thread drives and `blocking` is False."""
        if not self._drive.acquire(blocking):
            return False
        try:
            self._drain()
            if step and self.engine.has_work():
                self._step()
        finally:
            self._drive.release()
        return True

    def stream(self, request: Request, make_proposer: MakeProposer | None = None) -> Iterator[TokenEvent]:
        """The request's events, driving the engine (for every request in it) whenever no other
        thread does. A consumer that stops early cancels the request."""
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.submit(request, events.put, make_proposer)
        finished = False
        try:
            while not finished:
                try:
                    event = events.get_nowait()
                except queue.Empty:
                    if not self.drive(blocking=False):
                        try:
                            event = events.get(timeout=POLL_S)
                        except queue.Empty:
                            continue
                    else:
                        continue
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self.cancel(request.id)  # its K/V go to the prefix cache now, or at the driver's next turn
            self._flush()

    def _flush(self) -> None:
        """Take the inbox in (no step) unless another thread drives. Every caller leaving `stream`
        does: a cancel posted while it drove (its request ending in that step) has no one else to
        take it in, and the closed request would hold its row while no one drives."""
        while self._inbox and self.drive(blocking=False, step=False):
            pass

    # -- the driving thread ----------------------------------------------------------------------

    def _post(self, kind: str, item: object) -> None:
        with self._ready:
            self._inbox.append((kind, item))
            self._ready.notify_all()

    def _drain(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self._add(*item)
            elif kind == "cancel" and item in self._sinks:
                self.engine.cancel(item)
                del self._sinks[item]
            elif kind == "end" and item[0] in self._sinks:
                request_id, error = item
                row = self.engine.row_of(request_id)
                self.engine.cancel(request_id)
                event = TokenEvent([], "error", row.stats if row is not None else GenerationStats(), error)
                self._tell(request_id, self._sinks.pop(request_id), event)

    def _add(self, request: Request, sink: Sink, make_proposer: MakeProposer | None) -> None:
        try:
            if make_proposer is not None:
                request.proposer = make_proposer()
            self.engine.add(request)
        except Exception as e:  # noqa: BLE001 - the caller's to report, never the engine's
            release_proposer(request)  # (refused by the engine after its proposer was made)
            self._tell(request.id, sink, TokenEvent([], "error", error=e))
            return
        self._sinks[request.id] = sink

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a broken step must not take every caller down
            log.exception("engine step failed outside any request's pass; ending the requests it held")
            # every row, those that ended in the failed step too: their last events went with it
            for row in [*self.engine.rows, *([self.engine.filling] if self.engine.filling is not None else [])]:
                self.engine.cancel(row.request.id)
                if (sink := self._sinks.pop(row.request.id, None)) is not None:
                    self._tell(row.request.id, sink, TokenEvent([], "error", row.stats, e))
            return
        seconds = time.perf_counter() - start
        for observe in self.step_observers:
            observe(seconds)
        for request_id, event in events:
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            if event.finish_reason is not None:
                del self._sinks[request_id]
            self._tell(request_id, sink, event)

    def _tell(self, request_id: str, sink: Sink, event: TokenEvent) -> None:
        """Hand a request its event. A sink that raises (its caller's bug) ends that request there:
        neither the thread driving (maybe another caller's generate) nor the step's other events
        (lost, they would leave their requests waiting forever) see the error."""
        try:
            sink(event)
        except Exception:  # noqa: BLE001
            log.exception("the sink of request %s raised; cancelling the request", request_id)
            self._sinks.pop(request_id, None)
            self.engine.cancel(request_id)
