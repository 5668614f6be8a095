"""/v1/responses, OpenAI's Responses API as an adapter over the chat route: the translation both ways
without a model, the route on the tiny random model, then (slow) the official openai client and
openai-agents against a server on the real SmolLM2-135M-Instruct (greedy, so every answer is one text).

Oracles: the chat route's own answer to the conversation a Responses request stands for (text,
calls, usage); the installed openai package's types, every event and response validated against
them; the client's stream accumulation against the whole response; jsonschema and pydantic for
json_schema outputs and call arguments; the prefix cache's count for a continuation.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field, ValidationError

import quickdraft
from quickdraft.server.errors import BadRequest
from quickdraft.server.response_store import ResponseStore
from quickdraft.server.responses_answer import Events, output_of
from quickdraft.server.responses_api import ResponsesRequest, chat_request, renamed, responses_param
from quickdraft.server.schemas import MAX_MESSAGES
from quickdraft.structured.conversation import template_message
from support.responses_api import sse
from support.server import NAME, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city, now",
          "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city, now",
                                                "parameters": WEATHER, "strict": True}}]
QUESTION = "What is the weather in Paris?"
SHORT = "What is 2+2? Answer with one number."  # SmolLM2 answers it in a few tokens, then stops


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": NAME, "input": "hi", **fields})


# -- the translation, without a model --------------------------------------------------------------------------

def test_a_conversation_becomes_the_chat_request_it_is() -> None:
    body = request(instructions="Be brief.", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, max_output_tokens=7, temperature=0.5, top_p=0.9, metadata={"k": "v"},
                   input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                      {"type": "input_text", "text": "here?"}]},
                          {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                           "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                          {"type": "function_call", "id": "fc_1", "call_id": "a", "name": "get_weather",
                           "arguments": '{"city": "Oslo"}', "status": "completed"},
                          {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "a", "output": "sun"},
                          {"type": "function_call_output", "call_id": "b",
                           "output": [{"type": "input_text", "text": "rain"}]},
                          {"role": "developer", "content": "Answer now."}])
    chat = chat_request(body, body.items())
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    assert [template_message(m) for m in chat.chat()] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather here?"},
                           {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                           {"role": "tool", "content": "sun", "tool_call_id": "a"},
                           {"role": "tool", "content": "rain", "tool_call_id": "b"},
                           {"role": "system", "content": "Answer now."}]
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == CHAT_TOOLS
    assert chat.tool_choice.model_dump() == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.parallel_tool_calls, chat.max_completion_tokens, chat.max_tokens) == (False, 7, None)
    assert (chat.temperature, chat.top_p, chat.metadata, chat.stream) == (0.5, 0.9, {"k": "v"}, False)
    assert chat.response_format is None and chat.store is None
    assert chat_request(request(), request().items()).chat() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}),
])
def test_text_format_becomes_the_response_format(fmt: dict, expected: dict | None) -> None:
    chat = chat_request(request(text={"format": fmt}), request().items())
    given = chat.response_format.model_dump(by_alias=True, exclude_none=True) if chat.response_format else None
    assert given == expected


@pytest.mark.parametrize("fields, where", [
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"n": 2}, "n"),
])
def test_what_the_adapter_cannot_serve_is_refused_by_name(fields: dict, where: str) -> None:
    with pytest.raises(ValidationError) as refused:
        request(**fields)
    assert {error["loc"][0] for error in refused.value.errors()} == {where}


def test_accepted_fields_change_nothing_generated() -> None:
    plain = chat_request(request(), request().items())
    extra = request(reasoning={"summary": "auto"}, include=[], truncation="disabled", service_tier="auto", user="u",
                    store=False, stream_options={"include_obfuscation": False}, top_logprobs=0, background=False)
    assert chat_request(extra, extra.items()) == plain


def test_a_conversation_past_a_chat_is_a_400_naming_input() -> None:
    items = [{"type": "message", "role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    with pytest.raises(BadRequest) as refused:
        chat_request(request(), items)
    assert refused.value.status == 400 and refused.value.param == "input"
    assert refused.value.message.startswith(f"input: List should have at most {MAX_MESSAGES} items")


@pytest.mark.parametrize("chat_param, param", [
    ("messages", "input"), ("messages.3.content", "input"), ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"), ("response_format.json_schema", "text.format"),
    ("tools.2.function.parameters", "tools.2.parameters"), ("tool_choice", "tool_choice"), (None, None)])
def test_the_chat_routes_400s_name_the_requests_fields(chat_param: str | None, param: str | None) -> None:
    assert responses_param(chat_param) == param
    refused = renamed(BadRequest(400, f"{chat_param}: too long", chat_param, "code"))
    assert (refused.status, refused.param, refused.code) == (400, param, "code")
    assert refused.message == (f"{param}: too long" if param else "None: too long")


USAGE = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 4},
         "completion_tokens_details": {"reasoning_tokens": 0}}


def chunk(content: str | None = None, calls: list | None = None, finish: str | None = None) -> dict[str, Any]:
    """A chat stream chunk as streaming.py sends it (tool_calls.delta's shapes)."""
    delta: dict[str, Any] = {"content": content, **({"tool_calls": calls} if calls else {})}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **({"usage": USAGE} if finish else {})}


def call_piece(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def streamed(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events = Events(request(tools=TOOLS), "resp_1", 0)
    text = "".join(events.start() + [e for c in chunks for e in events.chunk(c)])
    return sse(text), events.final


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("finish, status", [("tool_calls", "completed"), ("length", "incomplete")])
def test_stream_events_validate_and_end_as_the_whole_answer(finish: str, status: str) -> None:
    events, final = streamed([chunk("", None), chunk("Let me "), chunk("check."),
                              chunk(None, [call_piece(0, '{"city": ', "get_weather")]),
                              chunk(None, [call_piece(0, '"Oslo"}')]),
                              chunk(None, [call_piece(1, '{"city": "Rome"}', "get_weather")]), chunk("", None, finish)])
    whole = {"choices": [{"finish_reason": finish, "message": {
        "role": "assistant", "content": "Let me check.",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": '{"city": "Oslo"}'}},
                       {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": '{"city": "Rome"}'}}]}}]}
    output, _ = output_of(whole)
    assert without_ids(final["output"]) == without_ids(output)
    assert [item["status"] for item in output] == ["completed", "completed", status]
    assert final["status"] == status and events[-1]["type"] == f"response.{status}"
    assert final["incomplete_details"] == (None if status == "completed" else {"reason": "max_output_tokens"})
    assert final["usage"] == {"input_tokens": 9, "output_tokens": 5, "total_tokens": 14,
                              "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}
    Response.model_validate(final)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", kinds[-1]]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]  # each item as it closed is the one the response holds


def test_an_empty_answer_is_one_empty_message_streamed_or_whole() -> None:
    events, final = streamed([chunk("", None), chunk("", None, "stop")])
    output, _ = output_of({"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": ""}}]})
    assert without_ids(final["output"]) == without_ids(output) == [
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "", "annotations": []}]}]
    assert "response.output_text.delta" not in [e["type"] for e in events]


def test_a_stream_error_is_an_error_event() -> None:
    events = Events(request(), "resp_1", 0)
    text = "".join(events.start() + events.chunk({"error": {"message": "boom", "type": "server_error", "param": None,
                                                            "code": None}}))
    assert sse(text)[-1] == {"type": "error", "sequence_number": 2, "code": "server_error", "message": "boom",
                             "param": None}
    assert events.final is None


def test_the_store_drops_the_least_recently_used_by_count_and_by_bytes_and_keeps_tenants_apart() -> None:
    def kept(store: ResponseStore) -> list[str]:
        return [response_id for _, response_id in store.kept]

    def response(i: int, text: str = "") -> dict[str, Any]:
        return {"id": f"r{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}

    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": str(i)}], "a")
    assert store.get("r0", "a").conversation() == [{"role": "user", "content": "0"}, *response(0)["output"]]
    assert store.get("r0", "b") is None and not store.delete("r0", "b")  # another key's: not found
    store.put(response(3), [], "a")  # r1 is now the least recently used
    assert kept(store) == ["r2", "r0", "r3"] and store.get("r1", "a") is None
    small = store.kept["a", "r3"].size
    store.put(response(4, "x" * (10_000 - 2 * small)), [], "a")  # r2 goes by count, r0 by bytes: r3, r4 fill them
    assert kept(store) == ["r3", "r4"] and store.bytes == 10_000
    store.put(response(5, "x" * 20_000), [], "a")  # larger than the whole budget: not kept, nothing dropped
    assert kept(store) == ["r3", "r4"]
    assert store.delete("r4", "a") and not store.delete("r4", "a") and store.bytes == small


# -- the route, on the tiny random model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=2)
    yield s
    s.stop()


def test_the_route_answers_as_the_chat_route_whole_streamed_and_kept(tiny: Server) -> None:
    """Through the admission guard (a route outside it has no queue place to take: a 500), the chat
    route's answer, whole and streamed, every event and the response as the openai package types them."""
    body = {"model": NAME, "input": "The quick brown fox", "instructions": "Be brief.", "max_output_tokens": 12,
            "temperature": 0}
    whole = httpx.post(f"{tiny.url}/v1/responses", json=body, timeout=60).json()
    Response.model_validate(whole)
    chat = tiny.client.chat.completions.create(model=NAME, max_completion_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}])
    assert whole["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert whole["usage"]["output_tokens"] == chat.usage.completion_tokens
    events = sse(httpx.post(f"{tiny.url}/v1/responses", json={**body, "stream": True}, timeout=60).text)
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert httpx.get(f"{tiny.url}/v1/responses/{final['id']}").json() == final
    unkept = httpx.post(f"{tiny.url}/v1/responses", json={**body, "store": False}, timeout=60).json()
    assert unkept["output"][0]["content"] == whole["output"][0]["content"] and unkept["store"] is False
    assert httpx.get(f"{tiny.url}/v1/responses/{unkept['id']}").status_code == 404
    assert tiny.metrics()["quickdraft_requests_running"] == 0


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_refusals_are_openai_errors_naming_the_field(tiny: Server) -> None:
    url = f"{tiny.url}/v1/responses"
    assert error_of(httpx.post(url, json={"model": "gpt-4o", "input": "x"}), 404)["code"] == "model_not_found"
    assert error_of(httpx.post(url, json={"model": NAME, "input": "x", "background": True}), 400)["param"] == \
        "background"
    too_long = error_of(httpx.post(url, json={"model": NAME, "input": "x", "max_output_tokens": 10**6}), 400)
    assert too_long["code"] == "context_length_exceeded" and too_long["param"] == "max_output_tokens"
    schema = {"type": "json_schema", "name": "w", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}
    bad = error_of(httpx.post(url, timeout=60, json={"model": NAME, "input": "x", "text": {"format": schema}}), 400)
    assert bad["param"] == "text.format" and bad["code"] == "invalid_response_format"
    unknown = error_of(httpx.post(url, timeout=60, json={"model": NAME, "input": "x", "tools": TOOLS,
                                                         "tool_choice": {"type": "function", "name": "nope"}}), 400)
    assert unknown["param"] == "tool_choice" and unknown["code"] == "invalid_tools"
    for item in (None, 5, {"type": "image"}):  # pydantic's own words named its discriminator function
        odd = error_of(httpx.post(url, json={"model": NAME, "input": [{"role": "user", "content": "x"}, item]}), 400)
        assert odd["param"] == "input.1" and "expected an input item" in odd["message"] and "_item_type" not in \
            odd["message"], odd
    moved = httpx.put(f"{url}/resp_1")
    assert error_of(moved, 405) and set(moved.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_the_schema_publishes_the_routes(tiny: Server) -> None:
    schema = httpx.get(f"{tiny.url}/openapi.json").json()
    assert set(schema["paths"]["/v1/responses"]) == {"post"}
    assert set(schema["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    ids = [op["operationId"] for operations in schema["paths"].values() for op in operations.values()]
    assert len(ids) == len(set(ids))
    fields = schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert fields["model"]["enum"] == [NAME] and fields["max_output_tokens"]["anyOf"][0]["maximum"] == 2047
    assert fields["input"]["anyOf"][0]["maxLength"] == tiny.app.state.served.config.max_body_bytes


# -- the live server: the openai client and openai-agents --------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(quickdraft.load(), max_batch=2)
    yield s
    s.stop()


def chat_answer(server: Server, messages: list[dict], **kw: Any) -> Any:
    return server.client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


@pytest.mark.slow
def test_text_and_instructions_answer_as_the_chat_route(server: Server) -> None:
    for instructions in (None, "Answer in French."):
        r = server.client.responses.create(model=NAME, input=QUESTION, max_output_tokens=30, temperature=0,
                                           **({"instructions": instructions} if instructions else {}))
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = chat_answer(server, [*system, {"role": "user", "content": QUESTION}], max_completion_tokens=30)
        assert r.output_text == chat.choices[0].message.content and r.output_text
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert r.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
        assert r.id.startswith("resp_") and r.model == NAME and r.instructions == instructions
    assert r.output_text != server.client.responses.create(model=NAME, input=QUESTION, max_output_tokens=30,
                                                           temperature=0).output_text  # the instructions were read


@pytest.mark.slow
def test_out_of_tokens_is_incomplete(server: Server) -> None:
    raw = httpx.post(f"{server.url}/v1/responses", timeout=60,
                     json={"model": NAME, "input": QUESTION, "max_output_tokens": 3, "temperature": 0}).json()
    r = Response.model_validate(raw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.max_output_tokens == 3


@pytest.mark.slow
def test_a_stream_ends_as_the_whole_response(server: Server) -> None:
    whole = server.client.responses.create(model=NAME, input=SHORT, max_output_tokens=60, temperature=0)
    assert whole.status == "completed"
    with server.client.responses.stream(model=NAME, input=SHORT, max_output_tokens=60, temperature=0) as stream:
        kinds = [(e.type, e.sequence_number) for e in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert [n for _, n in kinds] == list(range(len(kinds)))
    assert kinds[0][0] == "response.created" and kinds[-1][0] == "response.completed"
    raw = httpx.post(f"{server.url}/v1/responses", timeout=60,
                     json={"model": NAME, "input": SHORT, "max_output_tokens": 60, "temperature": 0, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse(raw.text)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert server.client.responses.retrieve(events[-1]["response"]["id"]).output_text == whole.output_text


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_function_tool_loop(server: Server, tool_choice: Any) -> None:
    first = server.client.responses.create(model=NAME, input=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                           max_output_tokens=100, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and len(calls) == len(first.output)
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    with server.client.responses.stream(model=NAME, input=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                        max_output_tokens=100, temperature=0) as stream:
        pieces = [e for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output] == [(c.name, c.arguments) for c in calls]
    assert len(pieces) > len(calls)  # the arguments came in pieces
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, sunny"} for c in calls]
    answer = server.client.responses.create(model=NAME, previous_response_id=first.id, input=outputs, tools=TOOLS,
                                            tool_choice="none", max_output_tokens=40, temperature=0)
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for c in calls]},
               *({"role": "tool", "tool_call_id": c.call_id, "content": "18 C, sunny"} for c in calls)]
    chat = chat_answer(server, history, tools=CHAT_TOOLS, tool_choice="none", max_completion_tokens=40)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content and answer.output_text
    assert answer.usage.input_tokens == chat.usage.prompt_tokens and answer.previous_response_id == first.id


@pytest.mark.slow
def test_a_continuation_reuses_the_cached_prefix(server: Server) -> None:
    story = "Tell me about the sea and the ships on it, please. " * 4
    first = server.client.responses.create(model=NAME, input=story, max_output_tokens=24, temperature=0)
    second = server.client.responses.create(model=NAME, previous_response_id=first.id, input="And the harbours?",
                                            max_output_tokens=24, temperature=0)
    assert first.usage.input_tokens <= second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    chat = chat_answer(server, [{"role": "user", "content": story},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": "And the harbours?"}], max_completion_tokens=24)
    assert second.output_text == chat.choices[0].message.content


class Weather(BaseModel):
    city: str = Field(max_length=20)
    rain: bool


@pytest.mark.slow
def test_json_schema_text_format_is_followed(server: Server) -> None:
    r = server.client.responses.parse(model=NAME, input=QUESTION, text_format=Weather, max_output_tokens=60,
                                      temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Weather)
    r = server.client.responses.create(model=NAME, input=QUESTION, max_output_tokens=60, temperature=0,
                                       text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict) and r.text.format.type == "json_object"


@pytest.mark.slow
def test_retrieve_delete_and_store_false(server: Server) -> None:
    created = server.client.responses.create(model=NAME, input=SHORT, max_output_tokens=20, temperature=0,
                                             metadata={"run": "7"})
    assert server.client.responses.retrieve(created.id) == created and created.metadata == {"run": "7"}
    assert httpx.delete(f"{server.url}/v1/responses/{created.id}").json() == {
        "id": created.id, "object": "response.deleted", "deleted": True}
    for gone in (lambda: server.client.responses.retrieve(created.id),
                 lambda: server.client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            gone()
        assert missing.value.body["type"] == "not_found_error" and created.id in missing.value.body["message"]
    unkept = server.client.responses.create(model=NAME, input=SHORT, max_output_tokens=20, temperature=0, store=False)
    assert unkept.output_text == created.output_text
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as missing:
        server.client.responses.create(model=NAME, input="more", previous_response_id=unkept.id)
    assert missing.value.body["code"] == "previous_response_not_found"
    assert missing.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_an_openai_agent_calls_its_tool_and_answers(server: Server) -> None:
    """openai-agents' default model (Responses) against the server: a forced call of the agent's
    function tool, run by the agent; then the conversation as the agent hands it on (its items, the
    server's output items echoed back), answered in text as the chat route answers it."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city, now."""
        cities.append(city)
        return "18 C, sunny"

    async def run() -> tuple[Any, Any]:
        model = OpenAIResponsesModel(NAME, openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                                              max_retries=0))

        def agent(tool_choice: str, **kw: Any) -> Agent:
            return Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                         model_settings=ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=40), **kw)
        called = await Runner.run(agent("get_weather", tool_use_behavior="stop_on_first_tool"), QUESTION)
        answered = await Runner.run(agent("none"), called.to_input_list())
        return called, answered

    called, answered = asyncio.run(run())
    call = next(item for item in called.raw_responses[0].output if item.type == "function_call")
    assert cities == [json.loads(call.arguments)["city"]] and called.final_output == "18 C, sunny"
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    chat = chat_answer(server, history, max_completion_tokens=40)
    assert answered.final_output == chat.choices[0].message.content and answered.final_output
    assert len(cities) == 1  # the second run called nothing
