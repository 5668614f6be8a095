"""The FastAPI app: OpenAI-compatible routes over one engine thread, wired together.

create_app builds the state every route shares (state.Served: the model, the engine worker, the
metrics, the tokenizer's and the grammars' threads), puts the guards before the routes, and mounts
the route modules (routes/): each validates everything a request can get wrong before it reaches
the engine (requests.py), so a bad request is a 4xx and never touches the batch, and answers
through streaming.py, where a client that goes away cancels its request.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI

from quickdraft.api import LLM
from quickdraft.engine.policy import StepCost
from quickdraft.proposers import SpecConfig, SpecConfigError
from quickdraft.proposers.registry import registration, runs
from quickdraft.server import openapi
from quickdraft.server.config import ServerConfig
from quickdraft.server.errors import install_error_handlers
from quickdraft.server.guards import (
    ANTHROPIC,
    Admission,
    ApiKey,
    CountErrors,
    DeclaredBodyLimit,
    HostCheck,
    answered_hosts,
)
from quickdraft.server.messages_answer import AnthropicErrors
from quickdraft.server.metrics import Metrics
from quickdraft.server.prompts import Prompts
from quickdraft.server.requests import methods
from quickdraft.server.routes import chat, completions, health, messages, models, playground, responses_api
from quickdraft.server.state import Served
from quickdraft.server.worker import EngineWorker

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", ANTHROPIC,
                              f"{ANTHROPIC}/count_tokens"})  # count_tokens: a place while it tokenizes
GRAMMAR_THREADS = 2       # schemas compiled at once: a pathological one holds one thread, never the event loop


def create_app(llm: LLM, config: ServerConfig, cost: StepCost | None = None, engine_thread: bool = True,
               bind: str = "127.0.0.1") -> FastAPI:
    """engine_thread: run the engine on a thread started with the app; False leaves it to the
    caller to run `app.state.worker.run()` on its own thread (see worker.py for why). bind: the
    address served, which decides the Host names answered."""
    service = llm.engine_service(config.engine, cost)  # the model's one engine, shared with LLM.generate
    metrics = Metrics(llm.prefix)
    served = Served(llm, config, EngineWorker(service, metrics), metrics, Prompts(llm.tokenizer),
                    ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="quickdraft-grammar"),
                    _load_error(llm.draft_head, config.spec.head), _datastore_error(llm, config.spec))
    app = FastAPI(title="quickdraft", lifespan=functools.partial(_lifespan, engine_thread=engine_thread))
    app.state.served = served
    app.state.worker, app.state.metrics = served.worker, served.metrics  # what the HTTP front and replicas drive
    _guard(app, config, bind, served.metrics)
    install_error_handlers(app, config.max_body_bytes)
    for routes in (health, models, completions, chat, responses_api, messages):
        routes.install(app, config)
    openapi.publish(app, config.model_name, llm.model.config.vocab_size, served.context, lambda: methods(served),
                    config.max_body_bytes, bearer=bool(config.api_keys), max_choices=served.places)
    playground.install(app, config)
    return app


def _load_error(load: Callable[[str | None], object], path: str | None) -> str | None:
    """Why the server's draft head (or datastore) cannot load, or None. Loaded here, before the
    engine runs: a request asking for it then only reuses it (a datastore's table takes seconds)."""
    try:
        load(path)
    except SpecConfigError as e:
        return str(e)
    return None


def _datastore_error(llm: LLM, spec: SpecConfig) -> str | None:
    """Why requests here cannot draft from a datastore, or None. Its table is built at start (seconds,
    ~350 MB while it is built, ~50 MB kept for SmolLM2's) only where the server's own speculation
    drafts from it or one is named: a request asking for one then only reuses it."""
    if not spec.datastore and not (spec.enabled and registration(runs(spec.method, llm, spec)).loads == "datastore"):
        return ("this server was started without a datastore: start it with --spec store or lookup-store (or auto, "
                "where it picks one), or name one with --datastore FILE")
    return _load_error(llm.datastore, spec.datastore)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI, engine_thread: bool) -> AsyncIterator[None]:
    served: Served = app.state.served
    if engine_thread:
        served.worker.start()
    yield
    served.worker.stop()
    served.grammars.shutdown(wait=False, cancel_futures=True)


def _guard(app: FastAPI, config: ServerConfig, bind: str, metrics: Metrics) -> None:
    """The ASGI checks before a route. The last added runs first: count errors, write Anthropic's
    routes' errors in its envelope, check Host, the key, the body's size; the route takes a place in
    the queue (Admission) once the body is whole and valid."""
    app.add_middleware(DeclaredBodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(Admission, paths=GENERATION_PATHS, rows=config.engine.max_batch, waiting=config.max_waiting)
    if config.api_keys:
        app.add_middleware(ApiKey, keys=config.api_keys)
    if (hosts := answered_hosts(bind, config.allowed_hosts)) is not None:
        app.add_middleware(HostCheck, allowed=hosts)
    app.add_middleware(AnthropicErrors, prefix=ANTHROPIC)  # around every check that can refuse
    app.add_middleware(CountErrors, count=metrics.count_error)
