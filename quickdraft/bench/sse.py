"""Reading an OpenAI-compatible server's streamed answer (server-sent events), for the benchmarks
that time one as a client does."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx


def sse_chunks(r: httpx.Response, who: str) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a streamed answer, `[DONE]` left out; a refusal (not a 200) or an error
    chunk is a RuntimeError naming `who` (the server, or its URL)."""
    if r.status_code != 200:
        r.read()
        raise RuntimeError(f"{who} answered {r.status_code}: {r.text[:500]}")
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"{who}: server error: {chunk['error']}")
        yield chunk
