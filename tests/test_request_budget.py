"""Issue 45 item 6: a request's new tokens over all its choices are bounded (--max-request-tokens), so
one request with n = 16 and max_tokens = 4000 cannot hold 16 places for ten minutes. Over real HTTP
(uvicorn on 127.0.0.1) with the tiny model: past the bound a 400 naming the field that sets it, before
the request takes a place; within it, served."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from quickdraft.server.config import REQUEST_CONTEXTS, ServerConfig
from support.server import MAX_SEQ, NAME, PROMPTS, Server

BOUND = 64


@pytest.fixture(scope="module")
def small(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4, max_request_tokens=BOUND)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def default(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4)
    yield s
    s.stop()


def refused(server: Server, route: str, body: dict, param: str, total: int, bound: int = BOUND) -> str:
    r = httpx.post(f"{server.url}/v1/{route}", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert error["code"] == "request_tokens_exceeded", error
    assert f"{total} in all" in error["message"] and f"at most {bound} for one request" in error["message"], error
    assert "--max-request-tokens" in error["message"]
    return error["message"]


def test_past_the_bound_is_a_400_naming_the_field_and_within_it_is_served(small: Server) -> None:
    before = small.metrics().get("quickdraft_prompt_tokens_total", 0.0)
    refused(small, "completions", {"prompt": PROMPTS[0], "n": 4, "max_tokens": 17}, "max_tokens", 68)
    refused(small, "completions", {"prompt": [PROMPTS[0], PROMPTS[1]], "n": 2, "max_tokens": 20}, "max_tokens", 80)
    refused(small, "completions", {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 20}, "max_tokens", 80)
    chat = {"messages": [{"role": "user", "content": "Say hi"}]}
    refused(small, "chat/completions", {**chat, "n": 2, "max_completion_tokens": 40}, "max_completion_tokens", 80)
    refused(small, "chat/completions", {**chat, "n": 2, "max_tokens": 40}, "max_tokens", 80)
    refused(small, "responses", {"input": "Say hi", "max_output_tokens": 65}, "max_output_tokens", 65)
    # unset, a chat runs to the context: n x the context's rest, known once the prompt is tokenized
    r = httpx.post(f"{small.url}/v1/chat/completions", json={"model": NAME, **chat}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_completion_tokens", r.text
    assert "is unset, so each runs to the context's end" in error["message"] and "1 choices" in error["message"]
    assert small.metrics().get("quickdraft_prompt_tokens_total", 0.0) == before  # none reached the engine

    r = httpx.post(f"{small.url}/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "n": 4, "max_tokens": 16,
                                                        "temperature": 0.7, "seed": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4 and 0 < r.json()["usage"]["completion_tokens"] <= BOUND
    r = httpx.post(f"{small.url}/v1/chat/completions", json={"model": NAME, **chat, "n": 2, "max_tokens": 32},
                   timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def admitted(server: Server, route: str, body: dict) -> None:
    """A streamed request answered 200 and its first token; the client then leaves (its rows are freed)."""
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={"model": NAME, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert next(line for line in r.iter_lines() if line.startswith("data: "))


def test_the_default_admits_every_single_choice_request_and_bounds_large_n(default: Server) -> None:
    bound = REQUEST_CONTEXTS * MAX_SEQ
    chat = {"messages": [{"role": "user", "content": "Say hi"}]}
    admitted(default, "chat/completions", chat)  # unset: to the context's end, one context
    admitted(default, "chat/completions", {**chat, "n": REQUEST_CONTEXTS})  # n contexts' rest: the bound's use
    admitted(default, "completions", {"prompt": PROMPTS[1], "n": 4, "max_tokens": MAX_SEQ - 16})
    refused(default, "completions", {"prompt": PROMPTS[1], "n": 16, "max_tokens": 1000}, "max_tokens", 16000, bound)
    r = httpx.post(f"{default.url}/v1/chat/completions", json={"model": NAME, **chat, "n": REQUEST_CONTEXTS + 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert f"at most {bound} for one request" in r.json()["error"]["message"]


def test_a_bound_below_one_token_is_refused_where_built() -> None:
    with pytest.raises(ValueError, match="max_request_tokens must be at least 1, found 0"):
        ServerConfig(NAME, max_request_tokens=0)
    assert ServerConfig(NAME).request_tokens(4096) == 16384 and ServerConfig(NAME, max_request_tokens=9).request_tokens(1) == 9
