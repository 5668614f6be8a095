"""The FastAPI app: OpenAI-compatible routes over one engine thread.

Handlers validate everything a request can get wrong (schema, sampling settings, speculation,
context length) before it reaches the engine, so a bad request is a 4xx and never touches the
batch. Token events come back through an asyncio queue per request; a client that goes away
cancels its request, which frees its batch row at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from quickdraft import kernels
from quickdraft.api import LLM, Chunk, TextAssembler
from quickdraft.engine.batch import EngineConfig, Request, check_context
from quickdraft.engine.events import TokenEvent
from quickdraft.engine.policy import StepCost
from quickdraft.errors import ContextTooLong, QuickdraftError
from quickdraft.grammar import Constraint, GrammarError
from quickdraft.sampling import SamplingParams
from quickdraft.server import openapi, responses as out
from quickdraft.server.connections import ConnectionLimits
from quickdraft.server.errors import BadRequest, install_error_handlers
from quickdraft.server.guards import ADMIT, Admission, ApiKey, CountErrors, DeclaredBodyLimit, HostCheck, answered_hosts
from quickdraft.server.metrics import Metrics
from quickdraft.server.playground import install_playground
from quickdraft.server.prompts import Prompts
from quickdraft.server.schemas import SPEC_FIELDS, ChatCompletionRequest, CompletionRequest, _Common
from quickdraft.server.choices import Choice, logprobs_asked, seeds
from quickdraft.server import tool_calls
from quickdraft.tools import GENERIC, Tools, conversation, syntax_of
from quickdraft.server.worker import EngineWorker, ShuttingDown
from quickdraft.proposers import MAX_K, PROPOSERS, Proposer, SpecConfig, SpecConfigError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context
MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, past any context this server is likely to hold
MAX_WAITING = 64  # requests waiting for a batch row; more get a 429
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
CONTEXT = "context_length_exceeded"
GRAMMAR_TIMEOUT_S = 10.0  # a response_format's schema compiled for longer is a 400 (other requests go on meanwhile)
GRAMMAR_THREADS = 2       # schemas compiled at once: a pathological one holds one thread, never the event loop


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    spec: SpecConfig = SpecConfig()       # speculation for requests that do not choose their own
    engine: EngineConfig = EngineConfig(max_batch=8)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get a 413 before they are parsed
    max_waiting: int = MAX_WAITING        # generation requests beyond the batch's rows; past it a 429
    api_key: str | None = None            # if set, /v1 routes need Authorization: Bearer <api_key>
    allowed_hosts: tuple[str, ...] = ()   # Host names answered besides loopback ones (guards.answered_hosts)
    connections: ConnectionLimits = ConnectionLimits()  # open at once, header and body timeouts (connections.py)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, found {self.max_body_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be at least 0, found {self.max_waiting}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty (--api-key or QUICKDRAFT_API_KEY); give a key, or neither")


def create_app(llm: LLM, config: ServerConfig, cost: StepCost | None = None, engine_thread: bool = True,
               bind: str = "127.0.0.1") -> FastAPI:
    """engine_thread: run the engine on a thread started with the app; False leaves it to the
    caller to run `app.state.worker.run()` on its own thread (see worker.py for why). bind: the
    address served, which decides the Host names answered."""
    service = llm.engine_service(config.engine, cost)  # the model's one engine, shared with LLM.generate
    engine = service.engine
    try:  # loaded here, on the model's thread: a request asking for the head then only reuses it
        llm.draft_head(config.spec.head)
        head_error = None
    except SpecConfigError as e:
        head_error = str(e)
    metrics = Metrics(llm.prefix)
    worker = EngineWorker(service, metrics)
    prompts = Prompts(llm.tokenizer)
    compiler = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="quickdraft-grammar")
    # how this model's template takes tools (tools.py), found once by rendering a probe
    syntax = GENERIC if not llm.tokenizer.has_chat_template else \
        syntax_of(lambda m, t: llm.tokenizer.chat_text(m, tools=t))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            worker.start()
        yield
        worker.stop()
        compiler.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="quickdraft", lifespan=lifespan)
    # the last added runs first: count errors, check Host, the key, the body's size; the route takes
    # a place in the queue (Admission) once the body is whole and valid
    app.add_middleware(DeclaredBodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(Admission, paths=GENERATION_PATHS, rows=config.engine.max_batch, waiting=config.max_waiting)
    if config.api_key is not None:
        app.add_middleware(ApiKey, key=config.api_key)
    if (hosts := answered_hosts(bind, config.allowed_hosts)) is not None:
        app.add_middleware(HostCheck, allowed=hosts)
    app.add_middleware(CountErrors, count=metrics.count_error)
    # per route, inside DeclaredBodyLimit: FastAPI's limit counts the bytes of bodies of no declared length
    body_limit = config.max_body_bytes
    app.state.worker, app.state.metrics = worker, metrics
    install_error_handlers(app, config.max_body_bytes)

    runtime = {"weights": llm.model.weight_format, "kernel": kernels.kernel_info().isa or "none (torch path)"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness, and which weights and CPU kernel answer (no silent slow path)."""
        return {"status": "ok", **runtime}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        """Prometheus' text format."""
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    auth = (401,) if config.api_key is not None else ()

    @app.get("/v1/models", responses=openapi.errors(*auth))
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "quickdraft"}]}

    generation = {**openapi.GENERATION, **openapi.errors(400, *auth, 404, 408, 413, 429, 500, 503)}

    @app.post("/v1/completions", max_body_size=body_limit, responses=generation)
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        arrived = time.perf_counter()
        _check_model(body)
        spec = _spec(body)
        constraints = await _constraint(body)
        budget = {"max_tokens": body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS}
        if isinstance(body.prompt, str):
            ids = await _tokenized(body.prompt, budget, "prompt", http, add_special_tokens=True, n=body.n)
        else:
            ids = list(body.prompt)
            _fits(len(ids), budget, "prompt")
            vocab = llm.model.config.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise BadRequest(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            http.scope[ADMIT](body.n)
        return await _respond("completion", body, spec, constraints, ids, budget, http, arrived)

    @app.post("/v1/chat/completions", max_body_size=body_limit, responses=generation)
    async def chat(body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        arrived = time.perf_counter()
        _check_model(body)
        spec = _spec(body)
        tools = tool_calls.tools_of(body)  # checked: a 400 naming the field
        constraints = await _constraint(body, tools)
        # max_completion_tokens wins (OpenAI's newer name); both are checked against the context
        budget = {"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens}
        try:
            text = await prompts.chat_text(*conversation(body.chat(), tools, syntax))
        except QuickdraftError as e:
            raise BadRequest(400, str(e), "messages") from None
        ids = await _tokenized(text, budget, "messages", http, add_special_tokens=False, n=body.n)
        return await _respond("chat", body, spec, constraints, ids, budget, http, arrived, tools)

    async def _tokenized(text: str, budget: dict[str, int | None], param: str, http: HTTPRequest,
                         add_special_tokens: bool, n: int) -> list[int]:
        """The text's token ids: refused first if its length alone says it cannot fit, then n places
        in the queue (n choices), then the tokenizer (off the event loop, a few at a time)."""
        try:
            _fits(await prompts.min_tokens(text), budget, param, at_least=True)
            http.scope[ADMIT](n)
            return await prompts.encode(text, add_special_tokens)
        except QuickdraftError as e:
            raise BadRequest(400, str(e), param) from None
        finally:
            prompts.done_with(text)

    def _fits(n: int, budget: dict[str, int | None], param: str, at_least: bool = False) -> None:
        """A prompt of n tokens (at least n: known from its length alone) and each budget field fit
        the context, or a 400."""
        limit = engine.max_seq_len
        has = f"at least {n}" if at_least else f"{n}"
        if at_least and n >= limit:
            raise BadRequest(400, f"the prompt has at least {n} tokens (from its length: no token stands for more "
                                  f"than {prompts.bytes_per_token} bytes) but the context holds {limit}; expected at "
                                  f"most {limit - 1} so at least one token can be generated", param, CONTEXT)
        if not at_least:
            try:
                check_context(n, limit)
            except ContextTooLong as e:
                raise BadRequest(400, str(e), param, CONTEXT) from None
        for field, wanted in budget.items():
            if wanted is not None and n + wanted > limit:
                raise BadRequest(400, f"the prompt has {has} tokens and {field} asks for {wanted} more, but "
                                      f"the context holds {limit}; expected at most {limit - n} new tokens",
                                 field, CONTEXT)

    def _unusable(spec: SpecConfig) -> str | None:
        """Why this server cannot run `spec`, or None: what it can run depends on the models it has."""
        if spec.needs_head and head_error:
            return head_error
        try:
            if spec.enabled and PROPOSERS[spec.method].loads == "draft_model":
                llm.draft_name(spec.draft_model)  # loads nothing; an error names the missing flag
        except SpecConfigError as e:
            return str(e)
        return None

    def _methods() -> list[str]:
        """The speculation methods a request may name here (for the published schema)."""
        usable = []
        for method in ["none", *sorted(PROPOSERS)]:
            spec = replace(config.spec, method=method, k=max(config.spec.k, 1))
            if _unusable(spec) is None:
                usable.append(method)
        return usable

    def _check_model(body: _Common) -> None:
        """Before any work on the prompt: a request for another model costs nothing, nor one for
        more choices than the server ever holds (each choice takes a place, Admission)."""
        if body.model != config.model_name:
            raise BadRequest(404, f"model {body.model!r} is not served here; this server serves "
                                  f"{config.model_name!r}", "model", "model_not_found")
        if body.n > (places := config.engine.max_batch + config.max_waiting):
            raise BadRequest(400, f"n asks for {body.n} choices, each a request of its own, but this server holds "
                                  f"{places} requests at once (--max-batch + --max-waiting); expected at most "
                                  f"{places}", "n")

    def _spec(body: _Common) -> SpecConfig:
        """The request's speculation, checked (before any work on its prompt)."""
        spec = config.spec
        if body.speculative is not None:
            chosen = body.speculative.model_dump(exclude_none=True)
            own = {name: value for name, value in chosen.items() if name in SPEC_FIELDS}
            options = {name: value for name, value in chosen.items() if name not in SPEC_FIELDS}
            try:  # SpecConfig validates (unknown method, k range, no draft, the proposer's option values)
                spec = replace(spec, **own, options={**spec.options, **options})
            except SpecConfigError as e:
                raise BadRequest(400, str(e), "speculative", "invalid_speculation") from None
        if problem := _unusable(spec):
            raise BadRequest(400, problem, "speculative", "invalid_speculation")
        return spec

    async def _constraint(body: _Common, tools: Tools | None = None) -> list[Constraint | None]:
        """The request's response_format, or its tools' grammar, compiled (off the event loop, within
        GRAMMAR_TIMEOUT_S), or a 400 naming it: one per choice (each follows its own text); Nones
        without one."""
        fmt = body.response_format.constrains() if body.response_format is not None else None
        if fmt is None and tools is None:
            return [None] * body.n
        if tools is None:
            make, param, code = (lambda: llm.constraint(fmt)), "response_format", "invalid_response_format"
        else:
            make, param, code = (lambda: tool_calls.compile_tools(llm.grammar_vocabulary(), tools, syntax)), "tools", \
                tool_calls.CODE
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(compiler, llm.grammar_vocabulary)  # once per model (~1 s), not the schema's time
        try:
            return [await asyncio.wait_for(loop.run_in_executor(compiler, make), GRAMMAR_TIMEOUT_S)
                    for _ in range(body.n)]
        except GrammarError as e:
            raise BadRequest(400, str(e), param, code) from None
        except TimeoutError:
            raise BadRequest(400, f"the schema did not compile within {GRAMMAR_TIMEOUT_S:g} s; give a simpler one",
                             param, code) from None

    def _prepare(body: _Common, spec: SpecConfig, constraints: list[Constraint | None], ids: list[int],
                 budget: dict[str, int | None]) -> tuple[list[tuple[Request, Callable[[], Proposer | None]]],
                                                         SamplingParams]:
        """Per choice, its request and the call that builds its proposer; budget: the fields that
        bound the new tokens, the first one given deciding."""
        limit = engine.max_seq_len
        _fits(len(ids), budget, "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        max_tokens = next((wanted for wanted in budget.values() if wanted is not None), None)
        stop = tuple(body.stop or ())
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        vocab = llm.model.config.vocab_size
        if any(token >= vocab for token in bias):
            raise BadRequest(400, f"logit_bias names token {max(bias)}; token ids are 0..{vocab - 1}", "logit_bias")
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                                seed=body.seed, max_new_tokens=max_tokens or limit - len(ids), stop=stop,
                                logit_bias=bias, presence_penalty=body.presence_penalty or 0.0,
                                frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs_asked(body))
        return [llm.request(ids, replace(params, seed=seed), spec, constraint)
                for seed, constraint in zip(seeds(params.seed, body.n), constraints)], params

    async def _respond(kind: out.Kind, body: _Common, spec: SpecConfig, constraints: list[Constraint | None],
                       ids: list[int], budget: dict[str, int | None], http: HTTPRequest, arrived: float,
                       tools: Tools | None = None) -> Response:
        made, params = _prepare(body, spec, constraints, ids, budget)
        replies = [tool_calls.ToolReply(tools, syntax, request.id) if tools and tools.callable() else None
                   for request, _ in made]  # none: free text, nothing to read
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, TokenEvent] | None] = asyncio.Queue()
        choices = []
        for index, (request, make_proposer) in enumerate(made):
            worker.submit(request, _sink(loop, events, index), make_proposer)
            assembler = TextAssembler(llm.tokenizer, params, pieces=body.stream or params.logprobs is not None)
            choices.append(Choice(index, request, _Timed(assembler, metrics, arrived).feed, kind,
                                  llm.tokenizer.token_bytes))
        if body.stream:
            return StreamingResponse(_stream(kind, choices, events, body.include_usage, replies),
                                     media_type="text/event-stream")
        return await _whole(kind, choices, events, http, replies)

    def _finished(choice: Choice) -> None:
        """A choice whose text has ended: the engine stops its request too (a stop string ends the text first)."""
        if not choice.engine_done:
            choice.engine_done = True
            worker.cancel(choice.request.id)

    async def _whole(kind: out.Kind, choices: list[Choice], events: asyncio.Queue[tuple[int, TokenEvent] | None],
                     http: HTTPRequest, replies: list[tool_calls.ToolReply | None]) -> Response:
        watcher = asyncio.create_task(_put_none_on_disconnect(http, events))
        try:
            left = len(choices)
            while left:
                item = await events.get()
                if item is None:  # the client left: nobody reads the answer (499, as nginx logs it)
                    return Response(status_code=499)
                choice, event = choices[item[0]], item[1]
                if choice.finish_reason is not None:  # ended by a stop string; the engine's last steps
                    continue
                if isinstance(event.error, ShuttingDown):
                    return out.error_response(503, str(event.error), "server_error", code="server_shutting_down")
                if event.error is not None:
                    return out.error_response(500, f"generation failed: {event.error}", "server_error")
                if choice.feed(event).finish_reason is not None:
                    _finished(choice)
                    left -= 1
            bodies = [tool_calls.rewritten(c.body(), reply) for c, reply in zip(choices, replies)]
            return JSONResponse(out.whole(kind, choices[0].request.id, config.model_name, bodies,
                                          [c.stats for c in choices]))
        finally:
            watcher.cancel()
            for choice in choices:
                _finished(choice)

    async def _stream(kind: out.Kind, choices: list[Choice], events: asyncio.Queue[tuple[int, TokenEvent] | None],
                      include_usage: bool, replies: list[tool_calls.ToolReply | None]) -> AsyncIterator[str]:
        request_id = choices[0].request.id  # one id for the whole stream, each chunk naming its choice
        try:
            left = len(choices)
            while left:
                index, event = await events.get()
                choice = choices[index]
                if choice.finish_reason is not None:
                    continue
                if event.error is not None:
                    yield out.sse_error(str(event.error) if isinstance(event.error, ShuttingDown)
                                        else f"generation failed: {event.error}")
                    break
                chunk = choice.feed(event)
                if chunk.text or chunk.token_ids or chunk.finish_reason is not None:  # ids: for their origins
                    content, calls, finish = tool_calls.delta(chunk.text, chunk.finish_reason, replies[index])
                    yield out.sse_chunk(kind, request_id, config.model_name, content, finish,
                                        chunk.stats, choice.first, out.token_origins(chunk), index,
                                        choice.chunk_logprobs(chunk), tool_calls=calls)
                    choice.first = False
                if chunk.finish_reason is not None:
                    _finished(choice)
                    left -= 1
            if not left and include_usage:
                yield out.sse_usage(kind, request_id, config.model_name, [c.stats for c in choices])
            yield out.SSE_DONE
        finally:  # also when the client disconnected and this generator was cancelled
            for choice in choices:
                _finished(choice)

    openapi.publish(app, config.model_name, llm.model.config.vocab_size, engine.max_seq_len, _methods,
                    config.max_body_bytes, bearer=config.api_key is not None,
                    max_choices=config.engine.max_batch + config.max_waiting)
    default = {"method": config.spec.method if config.spec.enabled else "none", "k": config.spec.k}
    install_playground(app, lambda: {"model": config.model_name, "speculative": default, "methods": _methods(),
                                     "max_k": MAX_K, "context": engine.max_seq_len})
    return app


class _Timed:
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


def _sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[tuple[int, TokenEvent] | None],
          index: int) -> Callable[[TokenEvent], None]:
    """Hands the engine thread's events of choice `index` to a handler on the event loop."""
    def put(event: TokenEvent) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the loop has closed (the server stopped): nobody is left to tell
            pass
    return put


async def _put_none_on_disconnect(http: HTTPRequest, events: asyncio.Queue[tuple[int, TokenEvent] | None]) -> None:
    """The body has been read, so the next ASGI message is the disconnect (as for Starlette's
    StreamingResponse, which cancels a stream's generator on it)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait(None)
