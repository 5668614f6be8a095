"""The Anthropic Messages API's server-sent events, read back (test_messages_api's)."""
from __future__ import annotations

import json


def sse(events: list[str]) -> list[dict]:
    """Server-sent events -> their data, each checked to be named by its type."""
    parsed = []
    for e in events:
        name, data = e.removesuffix("\n\n").split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {parsed[-1]['type']}"
    return parsed
