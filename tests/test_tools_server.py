"""Tools over HTTP on the tiny model (its template knows no tools: the generic syntax): calls in the
reply's message and streamed as delta.tool_calls, the same under every proposer; tool results in the
history; bad tool fields a 400 naming the field.

Oracles: jsonschema's validator for each call's arguments; the reply under plain decoding for the
same request under speculation; the openai client's own stream accumulation against the whole reply;
the prompt the server tokenized (usage) against conversation.conversation written through the template.
"""
from __future__ import annotations

import json
from typing import Iterator

import httpx
import jsonschema
import pytest

from quickdraft.proposers import SpecConfig
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.conversation import conversation
from quickdraft.structured.tools import GENERIC, Function, Tools
from support.server import NAME, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
SPECS = [{"method": "none"}, {"method": "ngram", "k": 6}, {"method": "ngram-tree", "k": 8}, {"method": "draft", "k": 3}]


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4)
    yield s
    s.stop()


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_calls_validate_stream_as_deltas_and_are_the_same_under_every_proposer(server: Server, tool_choice) -> None:
    replies = []
    for speculative in SPECS:
        r = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                                  max_tokens=300, temperature=0,
                                                  extra_body={"speculative": speculative})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = calls_of(choice.message)
        assert calls and all(c.id and c.type == "function" for c in choice.message.tool_calls)
        valid(calls)
        if isinstance(tool_choice, dict):
            assert {name for name, _ in calls} == {"get_time"}
        replies.append(calls)
        with server.client.chat.completions.stream(model=NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                                   max_tokens=300, temperature=0,
                                                   extra_body={"speculative": speculative}) as stream:
            pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion()
        assert calls_of(final.choices[0].message) == calls and final.choices[0].finish_reason == "tool_calls"
        assert len(pieces) > len(calls)  # arguments came in pieces, not whole at the end
    assert all(calls == replies[0] for calls in replies), replies


def test_parallel_tool_calls_false_is_one_call_and_none_is_text(server: Server) -> None:
    r = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=300, temperature=0.9, seed=4)
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    r = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="none",
                                              max_tokens=20, temperature=0)
    plain = server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain.choices[0].message.content


def test_sampled_calls_validate_in_every_choice(server: Server) -> None:
    r = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, temperature=1.0, seed=11, n=3,
                                              extra_body={"speculative": {"method": "ngram", "k": 4}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        valid(calls_of(choice.message))


def test_auto_gives_text_or_calls_and_the_stream_agrees(server: Server) -> None:
    for seed in range(3):
        kw = dict(model=NAME, messages=USER, tools=TOOLS, max_tokens=60, temperature=1.0, seed=seed)
        whole = server.client.chat.completions.create(**kw).choices[0]
        content, calls = "", {}  # (the client's stream helper refuses to parse a reply cut by max_tokens)
        for chunk in server.client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                name, arguments = calls.get(call.index, (call.function.name, ""))
                calls[call.index] = (name, arguments + call.function.arguments)
        assert (content or None, list(calls.values())) == (whole.message.content, calls_of(whole.message))
        if whole.message.tool_calls:
            assert whole.finish_reason == "tool_calls" and not whole.message.content
            valid(calls_of(whole.message))
        else:
            assert not whole.message.content.startswith("{")  # text never begins as the calls do


def test_tools_with_a_response_format_answer_calls_or_json_under_the_schema(server: Server) -> None:
    """openai-agents' output_type with tools, pydantic-ai's NativeOutput with tools: sampled, some
    seeds call and some answer; every answer is JSON under the schema, never free text."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "rain": {"type": "boolean"}},
              "required": ["city", "rain"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": answer, "strict": True}}
    kinds = set()
    for seed in range(6):
        choice = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=80,
                                                       temperature=1.0, seed=seed, response_format=fmt).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            valid(calls_of(choice.message))
            kinds.add("calls")
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), answer)
            kinds.add("answer")
    assert kinds, "no seed gave a whole reply within max_tokens"
    forced = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                                   max_tokens=80, temperature=0, response_format=fmt).choices[0]
    assert forced.finish_reason == "tool_calls", forced  # required: calls, whatever the format


def test_a_tool_result_continues_the_conversation(server: Server, llm) -> None:
    first = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                                  max_tokens=300, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = [*USER, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Rain, 4 C"}]
    r = server.client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=30,
                                              temperature=0, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    # the prompt the server wrote: the call and its result as JSON turns, no tools listed (none)
    messages, _ = conversation([*USER, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                                {"role": "tool", "tool_call_id": call.id, "content": "Rain, 4 C"}],
                               Tools((Function("get_weather", WEATHER), Function("get_time", TIME)), "none"), GENERIC)
    assert '"tool_response": {"name": "' + call.function.name in messages[2]["content"]
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(messages))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_the_python_api_gives_the_server_s_reply(server: Server, llm, tool_choice) -> None:
    """LLM.generate builds the server's prompt and grammar and reads the reply as the server does."""
    r = server.client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                              max_tokens=300, temperature=0, extra_body={"speculative": {"method": "none"}})
    reply = llm.generate(messages=USER, tools=TOOLS, tool_choice=tool_choice, params=SamplingParams(max_new_tokens=300),
                         spec=SpecConfig(method="none"))
    choice = r.choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()] == \
        [(c.name, c.arguments) for c in reply.tool_calls]
    assert (choice.finish_reason, choice.message.content or "") == (reply.finish_reason, reply.content)
    assert r.usage.completion_tokens == len(reply.token_ids)


BAD = [  # (fields, param, words in the message)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "'get_date', which is not among the tools (get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools.1.function.parameters", "objectx"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(x"}}}]},
     "tools.0.function.parameters", "compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "array", "uniqueItems": True}}}]}, "tools.0.function.parameters", "uniqueItems"),
    ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, "response_format", "objectx"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters",
     "dictionary"),
    ({"tools": [TOOLS[0]] * 129}, "tools", "at most 128"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    # an earlier call gone wrong beside the null content OpenAI's history writes: its own error, not content's
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": "oops"}]}, "messages.1.tool_calls",
     "valid list"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages.1.tool_calls.0.function.arguments", "valid string"),
]


@pytest.mark.parametrize("fields,param,says", BAD)
def test_bad_tool_fields_are_a_400_naming_the_field(server: Server, fields: dict, param: str, says: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": NAME, "messages": USER, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and error["message"].startswith(param), error


def test_the_published_schema_describes_tools(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    components = schema["components"]["schemas"]
    fields = components["ChatCompletionRequest"]["properties"]
    assert fields["tools"]["anyOf"][0]["maxItems"] == 128
    choices = fields["tool_choice"]["anyOf"]
    assert {"enum": ["none", "auto", "required"], "type": "string"} in choices
    assert components["FunctionDefinition"]["properties"]["name"]["pattern"] == "^[A-Za-z0-9_-]+$"
