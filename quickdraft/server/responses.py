"""OpenAI-shaped bodies: errors, completions and chat completions, whole and as stream chunks.

Pure functions of their inputs; the app decides when to send what.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Literal

from fastapi.responses import JSONResponse

from quickdraft.api import Chunk
from quickdraft.engine.events import GenerationStats

Kind = Literal["completion", "chat"]


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}  # OpenAI's field


def _envelope(kind: Kind, request_id: str, model: str, chunk: bool) -> dict[str, Any]:
    if kind == "chat":
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": int(time.time()), "model": model}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": model}


def whole(kind: Kind, request_id: str, model: str, text: str, finish_reason: str,
          stats: GenerationStats) -> dict[str, Any]:
    """A non-streaming response; `stats` is quickdraft's per-request statistics (an extra field)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_envelope(kind, request_id, model, chunk=False), "choices": [choice],
            "usage": usage(stats), "stats": stats.to_dict()}


def token_origins(chunk: Chunk) -> dict[str, Any]:
    """quickdraft's extension of a stream chunk (docs/server.md, "Token origins"): each token's
    id, text and origin, the target pass that committed them, and the running statistics."""
    stats = chunk.stats
    pieces = chunk.pieces if chunk.pieces is not None else [""] * len(chunk.token_ids)
    return {"pass": stats.target_passes,
            "tokens": [{"id": t, "text": text, "origin": o.kind, "depth": o.depth, "source": o.source}
                       for t, text, o in zip(chunk.token_ids, pieces, chunk.origins)],
            "new_tokens": stats.new_tokens, "committed_tokens": stats.committed_tokens, "elapsed_s": stats.total_s, "ttft_s": stats.ttft_s,
            "drafted_at": stats.drafted_at, "accepted_at": stats.accepted_at}


def sse_chunk(kind: Kind, request_id: str, model: str, text: str, finish_reason: str | None,
              stats: GenerationStats | None = None, first: bool = False,
              origins: dict[str, Any] | None = None) -> str:
    """One server-sent event; the last one (finish_reason set) carries usage and stats; origins:
    the "quickdraft" extension field (token_origins)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    body = {**_envelope(kind, request_id, model, chunk=True), "choices": [choice]}
    if finish_reason is not None and stats is not None:
        body.update(usage=usage(stats), stats=stats.to_dict())
    if origins is not None:
        body["quickdraft"] = origins
    return f"data: {json.dumps(body)}\n\n"


def sse_usage(kind: Kind, request_id: str, model: str, stats: GenerationStats) -> str:
    """stream_options.include_usage: after the last choice chunk, one with no choices and the usage."""
    body = {**_envelope(kind, request_id, model, chunk=True), "choices": [], "usage": usage(stats)}
    return f"data: {json.dumps(body)}\n\n"


def sse_error(message: str, kind: str = "server_error") -> str:
    return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'param': None, 'code': None}})}\n\n"


SSE_DONE = "data: [DONE]\n\n"
