"""The server's settings: one frozen ServerConfig, validated where built (the CLI's flags, tests)."""
from __future__ import annotations

from dataclasses import dataclass

from quickdraft.engine.batch import EngineConfig
from quickdraft.proposers import SpecConfig
from quickdraft.server.connections import ConnectionLimits

MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, past any context this server is likely to hold
MAX_WAITING = 64  # requests waiting for a batch row; more get a 429
REQUEST_CONTEXTS = 4  # the default budget of a request's new tokens over all its choices, in contexts: every
                      # single-choice request fits (at most one context), as do n <= 4 runs to the context


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    spec: SpecConfig = SpecConfig()       # speculation for requests that do not choose their own
    engine: EngineConfig = EngineConfig(max_batch=8)
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies get a 413 before they are parsed
    max_waiting: int = MAX_WAITING        # generation requests beyond the batch's rows; past it a 429
    api_keys: tuple[str, ...] = ()        # if any, /v1 routes need Authorization: Bearer <one of them>; each
                                          # key is a tenant with its own prefix-cache scope (prefix_cache.py)
    allowed_hosts: tuple[str, ...] = ()   # Host names answered besides loopback ones (guards.answered_hosts)
    connections: ConnectionLimits = ConnectionLimits()  # open at once, header and body timeouts (connections.py)
    max_request_tokens: int | None = None  # new tokens one request may ask for over its choices (n x max_tokens,
                                           # or n x the context's rest); None: REQUEST_CONTEXTS x the context

    def request_tokens(self, context: int) -> int:
        """The bound on a request's new tokens over all its choices, with a context of `context` tokens."""
        return REQUEST_CONTEXTS * context if self.max_request_tokens is None else self.max_request_tokens

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, found {self.max_body_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be at least 0, found {self.max_waiting}")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be at least 1, found {self.max_request_tokens}")
        if any(not key.strip() for key in self.api_keys):
            raise ValueError("an API key is empty (--api-key, --api-key-file or QUICKDRAFT_API_KEY); give a key, "
                             "or none")
