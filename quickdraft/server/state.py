"""What every route shares, as one frozen object: the model, the server's settings, the engine
worker, the metrics, the tokenizer's threads and the grammar threads. create_app builds it once and
puts it on `app.state.served`; a route reads it from its request (`served`), so a route module
mounts on any app that carries one. Knows no routes.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from quickdraft.api import LLM
from quickdraft.server.config import ServerConfig
from quickdraft.server.metrics import Metrics
from quickdraft.server.prompts import Prompts
from quickdraft.server.worker import EngineWorker


@dataclass(frozen=True)
class Served:
    llm: LLM
    config: ServerConfig
    worker: EngineWorker          # the door to the model's engine: submit and cancel
    metrics: Metrics
    prompts: Prompts              # the tokenizer's threads, and how the chat template takes tools
    grammars: ThreadPoolExecutor  # compiles response formats and tools' grammars off the event loop
    head_error: str | None = None  # why the server's draft head did not load: a request that needs it gets this
    datastore_error: str | None = None  # likewise for its datastore of the target's answers

    @property
    def context(self) -> int:
        """What a prompt and its new tokens must fit: the engine's context."""
        return self.worker.engine.max_seq_len

    @property
    def places(self) -> int:
        """Requests the server holds at once (--max-batch + --max-waiting), each choice one."""
        return self.config.engine.max_batch + self.config.max_waiting


def served(http: HTTPRequest) -> Served:
    return http.app.state.served
