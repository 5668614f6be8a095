"""The responses /v1/responses keeps (store: true), for GET /v1/responses/{id} and to continue a
conversation (previous_response_id): in memory, bounded by count and by bytes, the least recently
used dropped first. Each keeps its conversation's items whole (the earlier responses' included), so
a continuation needs only its predecessor. Each is its tenant's (its API key's, guards.TENANT): another
key's request does not find it, as OpenAI keeps responses per organization. Touched on the event loop
only, hence no lock.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20  # of the responses and items as JSON


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]     # the response object, as answered
    items: list[dict[str, Any]]  # its conversation's input items, before its output
    size: int                    # bytes, as JSON

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one comes after: its input, then its output."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.kept: OrderedDict[tuple[str, str], Stored] = OrderedDict()  # (tenant, id), least recently used first
        self.bytes = 0

    def put(self, response: dict[str, Any], items: list[dict[str, Any]], tenant: str) -> None:
        """Keep `response` for `tenant`; one larger than the whole budget is not kept."""
        stored = Stored(response, items, len(json.dumps(response)) + len(json.dumps(items)))
        if stored.size > self.max_bytes:
            return
        self.kept[tenant, response["id"]] = stored
        self.bytes += stored.size
        while len(self.kept) > self.max_responses or self.bytes > self.max_bytes:
            self.bytes -= self.kept.popitem(last=False)[1].size

    def get(self, response_id: str, tenant: str) -> Stored | None:
        stored = self.kept.get((tenant, response_id))
        if stored is not None:
            self.kept.move_to_end((tenant, response_id))
        return stored

    def delete(self, response_id: str, tenant: str) -> bool:
        stored = self.kept.pop((tenant, response_id), None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None
