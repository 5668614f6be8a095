"""The Responses API's server-sent events, read back and checked against the openai package's types
(test_responses_api's)."""
from __future__ import annotations

import json
from typing import Any

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

EVENTS = TypeAdapter(ResponseStreamEvent)


def sse(text: str) -> list[dict[str, Any]]:
    """A Responses stream's events, each checked against the openai package's type of its name."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events
