"""The one request pipeline (quickdraft/requests/): the same request through the Python API and
through the server gives the engine the same prompt ids, its reply's calls ids of the same form,
and the same refusal (message, field and code).

Oracle: each door against the other; the ids are read where both doors hand their requests to the
engine (LLM.request), not from what either reports.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import httpx
import pytest

from quickdraft.errors import RequestError
from quickdraft.spec.sampling import SamplingParams
from support.server import MAX_SEQ, NAME, Server

TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
HISTORY = [  # every normalization a chat gets: developer as system, text parts joined, earlier calls, a result
    {"role": "developer", "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}]},
    {"role": "user", "content": "What time is it in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "12:00"},
    {"role": "user", "content": "And in London?"}]
CALL_ID = re.compile(r"call_[A-Za-z0-9-]+_0")


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=2)
    yield s
    s.stop()


@pytest.fixture
def handed(llm, monkeypatch) -> list[list[int]]:
    """The prompt ids of every request either door hands the engine, in order."""
    seen: list[list[int]] = []
    request = llm.request

    def spy(ids, *args, **kwargs):
        seen.append(list(ids))
        return request(ids, *args, **kwargs)

    monkeypatch.setattr(llm, "request", spy)
    return seen


def post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": NAME, **body}, timeout=60)


ASKS = {  # name: (the Python API's arguments, the server's route and body)
    "chat with tools and history": ({"messages": HISTORY, "tools": TOOLS},
                                    ("chat/completions", {"messages": HISTORY, "tools": TOOLS})),
    "chat with a response format": ({"messages": HISTORY[1:2], "response_format": {"type": "json_object"}},
                                    ("chat/completions", {"messages": HISTORY[1:2],
                                                          "response_format": {"type": "json_object"}})),
    "prompt": ({"prompt": "Once upon a time"}, ("completions", {"prompt": "Once upon a time"})),
}


@pytest.mark.parametrize("name", sorted(ASKS))
def test_both_doors_hand_the_engine_the_same_prompt_ids(llm, server: Server, handed, name: str) -> None:
    kwargs, (route, body) = ASKS[name]
    llm.generate(**kwargs, params=SamplingParams(max_new_tokens=2, temperature=0.0))
    assert post(server, route, {**body, "max_tokens": 2, "temperature": 0}).status_code == 200
    assert len(handed) == 2 and handed[0] == handed[1] and len(handed[0]) > 3


def test_a_forced_call_has_an_id_of_the_same_form_through_both_doors(llm, server: Server) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    api = llm.generate(messages=HISTORY, tools=TOOLS, tool_choice=choice,
                       params=SamplingParams(max_new_tokens=120, temperature=0.0))
    r = post(server, "chat/completions", {"messages": HISTORY, "tools": TOOLS, "tool_choice": choice,
                                          "max_tokens": 120, "temperature": 0})
    http = r.json()["choices"][0]["message"]["tool_calls"]
    assert api.finish_reason == "tool_calls" and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert CALL_ID.fullmatch(api.tool_calls[0].id) and CALL_ID.fullmatch(http[0]["id"])
    assert (api.tool_calls[0].name, api.tool_calls[0].arguments) == (http[0]["function"]["name"],
                                                                     json.loads(http[0]["function"]["arguments"]))


LONG = "word " * (MAX_SEQ * 2)
REFUSALS = {  # name: (the Python API's arguments, the server's route and body, the field at fault)
    "a tool_choice naming no tool": (
        {"messages": HISTORY, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        ("chat/completions", {"messages": HISTORY, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
    "two tools of one name": ({"messages": HISTORY, "tools": TOOLS * 2},
                              ("chat/completions", {"messages": HISTORY, "tools": TOOLS * 2}), "tools"),
    "a tool_choice without tools": ({"messages": HISTORY, "tool_choice": "required"},
                                    ("chat/completions", {"messages": HISTORY, "tool_choice": "required"}),
                                    "tool_choice"),
    "a schema llguidance refuses": (
        {"messages": HISTORY, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}},
        ("chat/completions", {"messages": HISTORY, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}), "response_format"),
    "a tool's schema llguidance refuses": (
        {"messages": HISTORY, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objectx"}}}]},
        ("chat/completions", {"messages": HISTORY, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objectx"}}}]}), "tools.0.function.parameters"),
    "a prompt past the context": ({"prompt": LONG}, ("completions", {"prompt": LONG}), "prompt"),
    "a chat past the context": ({"messages": [{"role": "user", "content": LONG}]},
                                ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}), "messages"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_both_doors_refuse_alike(llm, server: Server, name: str) -> None:
    kwargs, (route, body), param = REFUSALS[name]
    with pytest.raises(RequestError) as refused:
        llm.generate(**kwargs, params=SamplingParams(max_new_tokens=2))
    r = post(server, route, {**body, "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400, r.text
    assert (error["message"], error["param"], error["code"]) == (str(refused.value), refused.value.param,
                                                                 refused.value.code), name
    assert refused.value.param == param and refused.value.code is not None


def test_a_prompt_its_length_refuses_is_refused_alike(llm, server: Server) -> None:
    """A text so long that its length alone says it cannot fit: refused before any tokenizer work,
    with the same message through both doors."""
    per_token = llm.tokenizer.bytes_per_token
    assert per_token is not None  # the tiny tokenizer has a length bound (else this checks nothing)
    text = "x" * (per_token * MAX_SEQ * 2)
    with pytest.raises(RequestError, match="from its length") as refused:
        llm.generate(text, params=SamplingParams(max_new_tokens=2))
    error = post(server, "completions", {"prompt": text, "max_tokens": 2}).json()["error"]
    assert (error["message"], error["param"], error["code"]) == (str(refused.value), "prompt", refused.value.code)
