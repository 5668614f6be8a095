"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat route: the
translation both ways without a model, then the live server driven by the official `anthropic` SDK.

Oracles: the chat route's own answer and prompt (usage) for the same conversation in OpenAI's shapes,
greedy, so text, stop reason and token counts must agree exactly; the SDK's own stream accumulation
(accumulate_event) against the whole answer; jsonschema for a tool's input; the SDK's exception
classes for the error envelope.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from pydantic import ValidationError
from starlette.responses import JSONResponse

from quickdraft.server.choices import Choice
from quickdraft.server.errors import BadRequest, validation_error
from quickdraft.server.messages_answer import AnthropicErrors, Events, matched_stop, message
from quickdraft.server.messages_api import CountTokensRequest, MessagesRequest, chat_request, messages_param
from quickdraft.server.schemas import MAX_MESSAGES
from quickdraft.structured.conversation import template_message
from support.http import unbounded
from support.messages_api import sse
from support.server import NAME, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "A forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                               "required": ["zone"], "additionalProperties": False}}]
USER = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
GREEDY = {"temperature": 0}  # not a keyword of this SDK's create(): sent as an extra field of the body
KEY = "qd-anthropic-key"


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": NAME, "max_tokens": 8, "messages": USER, **fields})


# -- the translation, without a model -----------------------------------------------------------------------

def test_a_conversation_becomes_the_chat_it_is() -> None:
    chat = chat_request(request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind.", "cache_control": {
            "type": "ephemeral"}}],
        messages=[*USER,
                  {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Oslo", "days": 3}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain"},
                                               {"type": "text", "text": "And tomorrow?"}]}],
        stop_sequences=["\n\n"], temperature=0.5, top_k=3, tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 3})}
    assert [template_message(m) for m in chat.chat()] == [
        {"role": "system", "content": "Be brief. Be kind."}, *USER,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                                         "function": call}]},
        {"role": "tool", "content": "Rain", "tool_call_id": "toolu_1"},  # before the user's text, as Anthropic has it
        {"role": "user", "content": "And tomorrow?"}]
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["\n\n"], 0.5, 3, 8)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert [(t.function.name, t.function.parameters) for t in chat.tools] == [(t["name"], t["input_schema"])
                                                                              for t in TOOLS]


def test_tool_results_each_a_chat_message_may_pass_the_chat_s_count() -> None:
    turn = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"},
                                        {"type": "text", "text": "go on"}]}
    chat = chat_request(request(system="s", messages=[turn] * MAX_MESSAGES))
    assert len(chat.messages) == 1 + 2 * MAX_MESSAGES and chat.messages[-2].role == "tool"


@pytest.mark.parametrize("choice, chat_choice", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                                 ({"type": "any"}, "required"),
                                                 ({"type": "tool", "name": "get_time"}, "get_time")])
def test_tool_choice_maps_to_the_chat_s(choice: dict, chat_choice: str) -> None:
    chat = chat_request(request(tools=TOOLS, tool_choice=choice))
    found = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.function.name
    assert found == chat_choice and chat.parallel_tool_calls is None


def test_output_format_is_a_response_format_and_count_tokens_has_no_sampling() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    chat = chat_request(request(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert chat.response_format.constrains() == {"type": "json_schema", "json_schema": {"name": "output",
                                                                                        "schema": schema}}
    counted = chat_request(CountTokensRequest.model_validate({"model": NAME, "messages": USER, "tools": TOOLS}))
    assert (counted.max_tokens, counted.stop, counted.stream, len(counted.tools)) == (None, None, False, 2)


@pytest.mark.parametrize("fields, param, fragment", [
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is ("}]}, "messages", "prefill"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.type", "budget (enabled) is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0",
     "'text', 'tool_result'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text",
     "surrogate"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "required with type tool"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type", ""),
    ({"service_tier": "priority"}, "service_tier", "one tier"),
    ({"mcp_servers": []}, "mcp_servers", "unknown field"),
])
def test_refusals_name_anthropic_s_field(fields: dict, param: str, fragment: str) -> None:
    try:
        chat_request(request(**fields))
    except ValidationError as e:  # as FastAPI reports it: the errors of the body
        message, found = validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])
    except BadRequest as e:
        message, found = e.message, e.param
    else:
        raise AssertionError(f"{fields} was accepted")
    assert found == param and fragment in message, (found, message)


def test_chat_fields_are_named_as_the_messages_request_names_them() -> None:
    assert [messages_param(p) for p in ("stop", "response_format", "tools.2.function.parameters",
                                        "tools.0.function.name", "messages.5.content", "max_tokens", None)] == [
        "stop_sequences", "output_config.format", "tools.2.input_schema", "tools.0.name", "messages", "max_tokens",
        None]


def completion(content: str | None, calls: list[tuple[str, dict]], finish: str) -> dict:
    return {"id": "chatcmpl-abc", "model": NAME, "choices": [{"finish_reason": finish, "message": {
        "role": "assistant", "content": content,
        "tool_calls": [{"id": f"call_abc_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                       for i, (n, a) in enumerate(calls)] or None}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
                  "prompt_tokens_details": {"cached_tokens": 12}}}


def test_a_whole_answer_is_a_message() -> None:
    m = message(completion("Hi.", [("get_time", {"zone": "UTC"})], "tool_calls"), None)
    assert m["id"] == "msg_abc" and (m["type"], m["role"], m["model"]) == ("message", "assistant", NAME)
    assert m["content"] == [{"type": "text", "text": "Hi."},
                            {"type": "tool_use", "id": "toolu_abc_0", "name": "get_time", "input": {"zone": "UTC"}}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("tool_use", None)
    assert m["usage"] == {"input_tokens": 18, "output_tokens": 7, "cache_read_input_tokens": 12,
                          "cache_creation_input_tokens": 0}
    for finish, stop, reason in (("stop", None, "end_turn"), ("length", None, "max_tokens"),
                                 ("stop", "END", "stop_sequence")):
        m = message(completion("", [], finish), stop)
        assert (m["content"], m["stop_reason"], m["stop_sequence"]) == ([], reason, stop)


def chunk(content: str | None = None, calls: list | None = None, finish: str | None = None) -> dict:
    delta = {"content": content, **({"tool_calls": calls} if calls else {})}
    usage = completion("", [], "stop")["usage"] if finish else None
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": usage}


def test_a_stream_s_events_accumulate_into_the_whole_message() -> None:
    """Text, then two calls whose arguments come in pieces: the SDK's own accumulation of the events
    gives the message the whole answer would be."""
    events = Events("abc", NAME, 30)
    script = [chunk("Let me "), chunk(""), chunk("see."),
              chunk(None, [{"index": 0, "id": "call_abc_0", "type": "function",
                            "function": {"name": "get_time", "arguments": '{"zone": '}}]),
              chunk(None, [{"index": 0, "function": {"arguments": '"UTC"}'}},
                           {"index": 1, "id": "call_abc_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", '}}]),
              chunk(None, [{"index": 1, "function": {"arguments": '"days": 2}'}}], "tool_calls")]
    data = sse([events.start(), *(e for c in script for e in events.chunk(c)), *events.end(None)])
    assert [d["type"] for d in data] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    snapshot, buffers = None, {}
    for d in data:
        snapshot = accumulate_event(event=d, current_snapshot=snapshot, json_bufs=buffers)
    whole = message(completion("Let me see.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo",
                                                                                                "days": 2})],
                               "tool_calls"), None)
    assert snapshot.model_dump(exclude_none=True, exclude={"content": {"__all__": {"parsed_output"}}}) == \
        {k: v for k, v in whole.items() if v is not None}


class Spelled:
    """A choice whose tokens are characters: decode is join."""

    def __init__(self, text: str, tokens: str, finish: str) -> None:
        self.choice = Choice(0, None, None, "chat", None)  # type: ignore[arg-type]
        self.choice.length, self.choice.ids, self.choice.finish_reason = len(text), [ord(c) for c in tokens], finish

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("text, tokens, finish, stops, found", [
    ("Hello", "Hello END", "stop", [" END", "E"], " END"),  # the text ends where the stop begins
    ("Hello", "HelloEND", "stop", ["END", "EN"], "EN"),      # both begin there: the shorter completed first
    ("Hello", "Hello", "stop", ["END"], None),               # the model's own end
    ("Hello", "Hello END", "length", [" END"], None),
    ("Hello", "Hello END", "stop", [], None)])
def test_the_stop_sequence_is_the_one_the_tokens_spell_past_the_text(text, tokens, finish, stops, found) -> None:
    spelled = Spelled(text, tokens, finish)
    assert matched_stop(spelled.choice, stops, spelled.decode) == found


def test_error_bodies_leave_in_anthropic_s_envelope() -> None:
    async def app(scope, receive, send) -> None:
        status = int(scope["path"].rsplit("/", 1)[1])
        body = {"error": {"message": "no", "type": "x", "param": "p", "code": "c"}} if status != 200 else {"ok": 1}
        await JSONResponse(body, status_code=status)(scope, receive, send)

    async def call(path: str) -> tuple[int, dict, dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)
        await AnthropicErrors(app, "/v1/messages")({"type": "http", "path": path}, None, send)
        body = b"".join(m.get("body", b"") for m in sent[1:])
        headers = dict(sent[0]["headers"])
        assert int(headers[b"content-length"]) == len(body)
        return sent[0]["status"], json.loads(body), headers

    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (413, "request_too_large"), (429, "rate_limit_error"), (503, "overloaded_error"),
                         (500, "api_error"), (405, "invalid_request_error")):
        assert asyncio.run(call(f"/v1/messages/{status}"))[:2] == (status, {"type": "error", "error": {
            "type": kind, "message": "no", "param": "p", "code": "c"}})
    assert asyncio.run(call("/v1/messages/200"))[1] == {"ok": 1}
    assert asyncio.run(call("/v1/chat/completions/400"))[1]["error"]["type"] == "x"  # other routes: OpenAI's


# -- the live server, with the anthropic SDK -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4)
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
    yield s
    s.stop()


def test_create_and_stream_answer_as_the_chat_route(server: Server) -> None:
    system, user = "Be brief.", [{"role": "user", "content": "Say hi"}]
    m = server.anthropic.messages.create(model=NAME, max_tokens=30, system=system, messages=user, extra_body=GREEDY)
    chat = server.client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": system}, *user],
                                                 max_tokens=30, temperature=0)
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", NAME)
    assert [(b.type, b.text) for b in m.content] == [("text", chat.choices[0].message.content)]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens and m.stop_sequence is None
    with server.anthropic.messages.stream(model=NAME, max_tokens=30, system=system, messages=user,
                                          extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == m.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, asked thrice


def test_a_stop_sequence_ends_the_text_and_is_named(server: Server) -> None:
    kw = dict(model=NAME, max_tokens=40, messages=[{"role": "user", "content": "Count to ten"}], extra_body=GREEDY)
    text = server.anthropic.messages.create(**kw).content[0].text
    stop = text[12:14]
    expected = text[:text.find(stop)]
    m = server.anthropic.messages.create(stop_sequences=["never seen", stop], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in m.content) == expected
    with server.anthropic.messages.stream(stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, "".join(b.text for b in final.content)) == (
        "stop_sequence", stop, expected)
    m = server.anthropic.messages.create(stop_sequences=["never seen"], **kw)
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("max_tokens", None, text)


def test_a_tool_loop_calls_then_reads_the_result(server: Server) -> None:
    """tool_choice forces the call; its input follows the schema and streams as input_json; the
    tool_result turn is the chat route's tool message: the same prompt (token count) and answer."""
    kw = dict(model=NAME, max_tokens=300, tools=TOOLS, extra_body=GREEDY)
    m = server.anthropic.messages.create(messages=USER, tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
    call = m.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    with server.anthropic.messages.stream(messages=USER, tool_choice={"type": "tool", "name": "get_weather"},
                                          **kw) as stream:
        json_pieces = [e for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert len(json_pieces) > 1 and (final.content[0].name, final.content[0].input) == (call.name, call.input)
    history = [*USER, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Rain, 4 C"}]}]
    answer = server.anthropic.messages.create(messages=history, tool_choice={"type": "none"},
                                              **{**kw, "max_tokens": 30})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    openai_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                    for t in TOOLS]
    chat = server.client.chat.completions.create(
        model=NAME, max_tokens=30, temperature=0, tools=openai_tools, tool_choice="none", messages=[
            *USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Rain, 4 C"}])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert answer.content[0].text == chat.choices[0].message.content
    one = server.anthropic.messages.create(messages=USER, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                           **kw)
    assert one.stop_reason == "tool_use" and len(one.content) == 1


def test_count_tokens_is_the_prompt_create_runs(server: Server) -> None:
    counts = []
    for extra in ({}, {"tools": list(TOOLS)}):
        counted = server.anthropic.messages.count_tokens(model=NAME, system="Be brief.", messages=USER, **extra)
        m = server.anthropic.messages.create(model=NAME, max_tokens=1, system="Be brief.", messages=USER, **extra)
        assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
        counts.append(counted.input_tokens)
    assert counts[1] > counts[0]  # the generic syntax lists the tools in the system turn


def test_errors_are_anthropic_s_envelope_with_the_routes_statuses(server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        server.anthropic.messages.create(model="claude-x", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error" and "'tiny'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic.messages.create(model=NAME, max_tokens=4, messages=USER, tools=[TOOLS[0]],
                                         tool_choice={"type": "tool", "name": "get_time"})
    assert (e.value.body["type"], e.value.body["error"]["type"]) == ("error", "invalid_request_error")
    assert e.value.body["error"]["param"] == "tool_choice"
    for body, status, param in (({"max_tokens": 4, "messages": USER, "top_p": 0}, 400, "top_p"),
                                ({"messages": USER}, 400, "max_tokens"),
                                ({"max_tokens": 4, "messages": USER, "temperature": 1.5}, 400, "temperature"),
                                ({"max_tokens": 10**6, "messages": USER}, 400, "max_tokens")):
        r = httpx.post(f"{server.url}/v1/messages", json={"model": NAME, **body}, timeout=30)
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("invalid_request_error", param), r.text
    r = httpx.post(f"{server.url}/v1/messages", content=b"x" * (2 << 20), timeout=30)  # refused by a guard
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(f"{server.url}/v1/messages/count_tokens")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_key_is_taken_as_x_api_key_too(llm) -> None:
    s = Server(llm, max_batch=4, api_keys=(KEY,))  # the module server's engine settings: one engine
    try:
        by_header = anthropic.Anthropic(base_url=s.url, api_key=None, default_headers={"X-Api-Key": KEY}, max_retries=0)
        by_bearer = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0)
        for client in (by_header, by_bearer):
            # greedy: a sampled reply may end at its first token (EOS drawn), which says nothing of the key
            assert client.messages.create(model=NAME, max_tokens=2, messages=USER,
                                          extra_body={"temperature": 0}).usage.output_tokens == 2
            assert client.messages.count_tokens(model=NAME, messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key=None, default_headers={"X-Api-Key": "nope"},
                                max_retries=0).messages.create(model=NAME, max_tokens=2, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error" and KEY not in str(e.value.body)
        r = httpx.post(f"{s.url}/v1/messages", json={"model": NAME, "max_tokens": 2, "messages": USER})
        assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/chat/completions", headers={"x-api-key": KEY},  # OpenAI's routes: Bearer only
                       json={"model": NAME, "max_tokens": 2, "messages": USER})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        security = httpx.get(f"{s.url}/openapi.json").json()["paths"]["/v1/messages"]["post"]["security"]
        assert security == [{"apiKey": []}, {"xApiKey": []}]
    finally:
        s.stop()


def test_the_published_schema_bounds_and_names_the_model(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    components = schema["components"]["schemas"]
    for request in ("MessagesRequest", "CountTokensRequest"):
        assert unbounded(components[request], components) == [], request
        assert components[request]["properties"]["model"]["enum"] == [NAME]
    assert components["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == server.worker.engine.max_seq_len - 1
    responses = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorBody")
