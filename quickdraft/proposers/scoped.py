"""Learned state kept apart per client: what a proposer learns from one prefix-cache scope's traffic
(its requests' text, the target's candidates after their tokens) drafts only for that scope's
requests. Shared across scopes, a table would tell a client what another sent: its drafts, and so
its speed and its accepted-token counts, would follow text it never saw (the prefix cache is scoped
for the same reason, prefix_cache.py).

Scopes come from API keys and from clients (cache_salt, prompt_cache_key), so their number is
unbounded: the `MAX_SCOPES` most recently used keep their state, an older one starts afresh when it
comes back (a request that holds its table keeps it until it ends).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

from quickdraft.proposers.base import ProposerContext

T = TypeVar("T")
MAX_SCOPES = 16  # tables kept at once per kind: a Qwen2.5 token-recycling table is 4.9 MB


class PerScope(Generic[T]):
    """One `make()` per scope, the `limit` most recently used kept."""

    def __init__(self, make: Callable[[], T], limit: int = MAX_SCOPES) -> None:
        self.make, self.limit = make, limit
        self.states: OrderedDict[str, T] = OrderedDict()
        self.lock = threading.Lock()  # proposers start on the server's request threads

    def get(self, scope: str) -> T:
        with self.lock:
            if scope not in self.states:
                self.states[scope] = self.make()
                while len(self.states) > self.limit:
                    self.states.popitem(last=False)
            self.states.move_to_end(scope)
            return self.states[scope]


def scoped(ctx: ProposerContext, key: Hashable, make: Callable[[], T]) -> T:
    """The state under `key` of the target's requests in ctx's scope."""
    return ctx.target.shared(("per scope", key), lambda: PerScope(make)).get(ctx.scope)
