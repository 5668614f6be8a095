"""OpenAI-shaped bodies: errors, completions and chat completions, whole and as stream chunks.

Pure functions of their inputs; the app decides when to send what.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse

from quickdraft.engine.events import GenerationStats
from quickdraft.requests.text import Chunk
from quickdraft.spec.logprobs import TokenLogprob

Kind = Literal["completion", "chat"]
Spell = Callable[[int], bytes]  # a token id -> its bytes (Tokenizer.token_bytes)
LOWEST_LOGPROB = -9999.0  # JSON has no -inf: a token the model rules out outright is reported this low (as vLLM)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def usage(*stats: GenerationStats, prompts: int = 1) -> dict:
    """One request's usage, of its choices' `stats`: their completions added, and the tokens of each of
    its `prompts` once (a batch's choices come in order, as many to each prompt)."""
    firsts = stats[::len(stats) // prompts]
    prompt, completion = sum(s.prompt_tokens for s in firsts), sum(s.new_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},  # OpenAI's fields
            "completion_tokens_details": {"reasoning_tokens": sum(s.reasoning_tokens for s in stats)}}


def logprobs(kind: Kind, ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], spell: Spell,
             offsets: Sequence[int]) -> dict[str, Any]:
    """A choice's logprobs in OpenAI's shape: chat's content list (token, logprob, bytes,
    top_logprobs), or the completions' parallel lists (tokens, token_logprobs, top_logprobs,
    text_offset: where each token's text starts in the choice's text; None: an echoed prompt's first
    token, which nothing scores, is null in both lists as OpenAI writes it)."""
    def text(token: int) -> tuple[str, list[int]]:
        raw = spell(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def value(logprob: float) -> float:
        return max(logprob, LOWEST_LOGPROB)

    if kind == "chat":
        def entry(token: int, logprob: float) -> dict[str, Any]:
            word, raw = text(token)
            return {"token": word, "logprob": value(logprob), "bytes": raw}
        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(ids, logprobs)], "refusal": None}
    def top(lp: TokenLogprob) -> dict[str, float]:  # keyed by text: of tokens that spell alike, the likeliest
        alternatives: dict[str, float] = {}
        for i, v in lp.top:
            alternatives.setdefault(text(i)[0], value(v))
        return alternatives

    return {"tokens": [text(t)[0] for t in ids],
            "token_logprobs": [None if lp is None else value(lp.logprob) for lp in logprobs],
            "top_logprobs": [None if lp is None else top(lp) for lp in logprobs], "text_offset": list(offsets)}


def _envelope(kind: Kind, request_id: str, model: str, chunk: bool) -> dict[str, Any]:
    if kind == "chat":
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": int(time.time()), "model": model}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": model}


def choice(kind: Kind, index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    """One choice of a non-streaming response (logprobs: as logprobs() writes them, if asked for)."""
    body: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["text"] = text
    return body


def whole(kind: Kind, request_id: str, model: str, choices: Sequence[dict[str, Any]],
          stats: Sequence[GenerationStats], prompts: int = 1) -> dict[str, Any]:
    """A non-streaming response; `stats` (per choice) are quickdraft's statistics (an extra field:
    the first choice's, and with several choices each choice's own in it too); prompts: a batch's."""
    if len(choices) > 1:
        choices = [{**c, "stats": s.to_dict()} for c, s in zip(choices, stats)]
    return {**_envelope(kind, request_id, model, chunk=False), "choices": list(choices),
            "usage": usage(*stats, prompts=prompts), "stats": stats[0].to_dict()}


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


def chunk(kind: Kind, request_id: str, model: str, text: str | None, finish_reason: str | None,
          stats: GenerationStats | None = None, first: bool = False,
          origins: dict[str, Any] | None = None, index: int = 0, logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """One stream chunk of choice `index`; its last one (finish_reason set) carries usage and
    stats; origins: the "quickdraft" extension field (token_origins); logprobs: this chunk's
    tokens', as logprobs() writes them; tool_calls and reasoning (reasoning_content, vLLM's and
    DeepSeek's name): the delta's (server/tool_calls.py)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if kind == "chat":
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        if reasoning:
            choice["delta"]["reasoning_content"] = reasoning
        if tool_calls:
            choice["delta"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    body = {**_envelope(kind, request_id, model, chunk=True), "choices": [choice]}
    if finish_reason is not None and stats is not None:
        body.update(usage=usage(stats), stats=stats.to_dict())
    if origins is not None:
        body["quickdraft"] = origins
    return body


def usage_chunk(kind: Kind, request_id: str, model: str, stats: Sequence[GenerationStats],
                prompts: int = 1) -> dict[str, Any]:
    """stream_options.include_usage: after the last choice chunk, one with no choices and the usage
    (of every choice: `stats`, of a batch's `prompts`)."""
    return {**_envelope(kind, request_id, model, chunk=True), "choices": [], "usage": usage(*stats, prompts=prompts)}


def error_chunk(message: str, kind: str = "server_error") -> dict[str, Any]:
    """What ends a stream that failed: an error body, as OpenAI's streams send one."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def sse(body: dict[str, Any]) -> str:
    """One server-sent event of a chat or completion stream."""
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
