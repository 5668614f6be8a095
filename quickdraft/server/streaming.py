"""A generation request's answer: its choices submitted to the engine worker, their token events
brought from the engine thread to the event loop (`_sink`), and read into OpenAI's server-sent
events (`stream`) or one JSON body (`whole`). A choice whose text has ended is cancelled in the
engine at once (a stop string ends the text before the engine knows); a client that goes away
cancels them all: Starlette cancels a stream's generator, a whole answer watches for the
disconnect and answers 499. Knows the worker's submit and cancel, not the engine's loop; the
request's checks are requests.py's.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quickdraft.engine.events import TokenEvent
from quickdraft.requests.reply import reasoning_counter
from quickdraft.requests.text import Chunk, TextAssembler
from quickdraft.server import responses as out
from quickdraft.server import tool_calls
from quickdraft.server.choices import Choice, Echo
from quickdraft.server.metrics import Metrics
from quickdraft.server.requests import Made
from quickdraft.server.schemas import _Common
from quickdraft.server.state import Served
from quickdraft.server.worker import ShuttingDown
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.tools import Tools, kept_markers

Events = asyncio.Queue[tuple[int, TokenEvent] | None]  # (choice index, event) from the engine thread; None: the client left


@dataclass(frozen=True)
class Answer:
    """One HTTP request's choices on their way out."""
    kind: out.Kind
    model: str                                  # the name the bodies carry
    choices: list[Choice]
    events: Events
    replies: list[tool_calls.ChatReply | None]  # per choice, its reply read (None: its text is its content)
    cancel: Callable[[str], None]               # ends a request in the engine (EngineWorker.cancel)
    prompts: int = 1                            # a batch's (its usage counts each prompt once)

    def finished(self, choice: Choice) -> None:
        """A choice whose text has ended: the engine stops its request too."""
        if not choice.engine_done:
            choice.engine_done = True
            self.cancel(choice.request.id)

    def close(self) -> None:
        for choice in self.choices:
            self.finished(choice)


async def respond(served: Served, kind: out.Kind, body: _Common, made: Made, params: SamplingParams,
                  http: HTTPRequest, arrived: float, tools: Tools | None = None,
                  echoes: list[Echo | None] | None = None) -> Response:
    """Submit the request's choices (n to a prompt; echoes: per choice, the prompt its text starts with)
    and answer: a stream if the body asks for one, else the whole."""
    answer = submit(served, kind, made, params, arrived, tools, pieces=body.stream or params.logprobs is not None,
                    echoes=echoes, prompts=len(made) // body.n)
    if body.stream:
        return StreamingResponse(stream(answer, body.include_usage), media_type="text/event-stream")
    return await whole(answer, http)


def submit(served: Served, kind: out.Kind, made: Made, params: SamplingParams, arrived: float,
           tools: Tools | None, pieces: bool, echoes: list[Echo | None] | None = None, prompts: int = 1) -> Answer:
    """Each choice's request queued in the engine, its events to come through one queue. Must run
    on the event loop (the sinks hand events to it); pieces: each token's text is kept."""
    tokenizer = served.llm.tokenizer
    loop = asyncio.get_running_loop()
    events: Events = asyncio.Queue()
    choices = []
    keep = kept_markers(tokenizer, served.prompts.syntax, tools)
    for index, (request, make_proposer) in enumerate(made):
        served.worker.submit(request, _sink(loop, events, index), make_proposer)
        counter = reasoning_counter(served.prompts.syntax, tools, chat=kind == "chat")
        timed = Timed(TextAssembler(tokenizer, params, pieces=pieces, keep=keep, reasoning=counter), served.metrics,
                      arrived)
        echo = echoes[index] if echoes else None
        choices.append(Choice(index, request, timed.feed, kind, tokenizer.token_bytes, echo))
    replies = [tool_calls.reply_of(served.prompts.syntax, tools, choice.request.id) if kind == "chat" else None
               for choice in choices]
    return Answer(kind, served.config.model_name, choices, events, replies, served.worker.cancel, prompts)


async def whole(answer: Answer, http: HTTPRequest) -> Response:
    """The answer as one JSON body once every choice has ended; 499 if the client left first."""
    body = await completed(answer, http)
    return JSONResponse(body) if isinstance(body, dict) else body


async def completed(answer: Answer, http: HTTPRequest) -> dict[str, Any] | Response:
    """The answer's completion body once every choice has ended, or the error answer that ends it
    (499: the client left first; 500: the engine failed; 503: the server is shutting down)."""
    watcher = asyncio.create_task(_put_none_on_disconnect(http, answer.events))
    try:
        left = len(answer.choices)
        while left:
            item = await answer.events.get()
            if item is None:  # the client left: nobody reads the answer (499, as nginx logs it)
                return Response(status_code=499)
            choice, event = answer.choices[item[0]], item[1]
            if choice.finish_reason is not None:  # ended by a stop string; the engine's last steps
                continue
            if isinstance(event.error, ShuttingDown):
                return out.error_response(503, str(event.error), "server_error", code="server_shutting_down")
            if event.error is not None:
                return out.error_response(500, f"generation failed: {event.error}", "server_error")
            if choice.feed(event).finish_reason is not None:
                answer.finished(choice)
                left -= 1
        bodies = [tool_calls.rewritten(c.body(), reply) for c, reply in zip(answer.choices, answer.replies)]
        return out.whole(answer.kind, answer.choices[0].request.id, answer.model, bodies,
                         [c.stats for c in answer.choices], answer.prompts)
    finally:
        watcher.cancel()
        answer.close()


async def stream(answer: Answer, include_usage: bool) -> AsyncIterator[str]:
    """The answer's chunks as server-sent events, then [DONE]."""
    pieces = chunks(answer, include_usage)
    try:
        async for body in pieces:
            yield out.sse(body)
        yield out.SSE_DONE
    finally:  # also when the client disconnected and this generator was cancelled
        await pieces.aclose()


async def chunks(answer: Answer, include_usage: bool) -> AsyncGenerator[dict[str, Any], None]:
    """The answer as stream chunks, one per choice's new text, then (include_usage) one with the
    usage of every choice; an engine error ends it with an error chunk (responses.error_chunk).
    The chat and completion routes send them as OpenAI's server-sent events, /v1/responses and
    /v1/messages as their own events."""
    request_id = answer.choices[0].request.id  # one id for the whole stream, each chunk naming its choice
    try:
        left = len(answer.choices)
        while left:
            index, event = await answer.events.get()
            choice = answer.choices[index]
            if choice.finish_reason is not None:
                continue
            if event.error is not None:
                yield out.error_chunk(str(event.error) if isinstance(event.error, ShuttingDown)
                                      else f"generation failed: {event.error}")
                return
            chunk = choice.feed(event)
            if choice.first and choice.echo is not None:  # the prompt first, in a chunk of its own
                yield out.chunk(answer.kind, request_id, answer.model, choice.echo.text, None, index=index,
                                logprobs=choice.echo_logprobs())
                choice.first = False
            if chunk.text or chunk.token_ids or chunk.finish_reason is not None:  # ids: for their origins
                content, reasoning, calls, finish = tool_calls.delta(chunk.text, chunk.finish_reason,
                                                                     answer.replies[index])
                yield out.chunk(answer.kind, request_id, answer.model, content, finish, chunk.stats, choice.first,
                                out.token_origins(chunk), index, choice.chunk_logprobs(chunk), tool_calls=calls,
                                reasoning=reasoning)
                choice.first = False
            if chunk.finish_reason is not None:
                answer.finished(choice)
                left -= 1
        if include_usage:
            yield out.usage_chunk(answer.kind, request_id, answer.model, [c.stats for c in answer.choices],
                                  answer.prompts)
    finally:  # also when the client disconnected and this generator was cancelled
        answer.close()


class Timed:
    """A request's text assembler that also times it for /metrics: time to the first text, and to
    the answer, from the request's arrival."""

    def __init__(self, text: TextAssembler, metrics: Metrics, arrived: float) -> None:
        self.text, self.metrics, self.arrived, self.first = text, metrics, arrived, True

    def feed(self, event: TokenEvent) -> Chunk:
        chunk = self.text.feed(event)
        now = time.perf_counter()
        if self.first and chunk.token_ids:
            self.metrics.ttft_s.observe(now - self.arrived)
            self.first = False
        if chunk.finish_reason in ("stop", "length"):
            self.metrics.request_s.observe(now - self.arrived)
        return chunk


def _sink(loop: asyncio.AbstractEventLoop, events: Events, index: int) -> Callable[[TokenEvent], None]:
    """Hands the engine thread's events of choice `index` to a handler on the event loop."""
    def put(event: TokenEvent) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the loop has closed (the server stopped): nobody is left to tell
            pass
    return put


async def _put_none_on_disconnect(http: HTTPRequest, events: Events) -> None:
    """The body has been read, so the next ASGI message is the disconnect (as for Starlette's
    StreamingResponse, which cancels a stream's generator on it)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait(None)
