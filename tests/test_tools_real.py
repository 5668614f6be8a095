"""Tools with the official openai client against a server on the real SmolLM2-135M-Instruct (its
template knows no tools: the generic syntax), and the Qwen2.5-Coder 0.5B's template found Hermes
(native). Slow: run with `pytest -m slow`.

Oracles: pydantic's validation of the calls' arguments (the client's own parsing of strict tools);
the reply under plain decoding for the same request under speculation; the client's stream
accumulation against the whole reply.
"""
from __future__ import annotations

import json
from typing import Iterator, Literal

import openai
import pytest
from pydantic import BaseModel, Field

import quickdraft
from quickdraft.structured.conversation import conversation
from quickdraft.structured.tools import HERMES, Function, Tools, syntax_of
from quickdraft.weights.gguf_file import open_reader, read_metadata
from quickdraft.weights.resolve import resolve_model
from quickdraft.weights.tokenizers import gguf_tokenizer
from support.server import NAME, Server

pytestmark = pytest.mark.slow


class GetWeather(BaseModel):
    """The weather in a city, now."""
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Weather(BaseModel):
    city: str = Field(max_length=20)
    rain: bool


QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(quickdraft.load(), max_batch=2)
    yield s
    s.stop()


@pytest.mark.parametrize("speculative", [{"method": "ngram", "k": 8}, {"method": "ngram-tree", "k": 8}])
def test_a_tool_calling_loop_call_result_answer(server: Server, speculative: dict) -> None:
    tools = [openai.pydantic_function_tool(GetWeather)]
    kw = dict(model=NAME, tools=tools, max_tokens=120, temperature=0)
    first = server.client.chat.completions.create(messages=QUESTION, tool_choice="required", **kw)
    plain = server.client.chat.completions.create(messages=QUESTION, tool_choice="required",
                                                  extra_body={"speculative": {"method": "none"}}, **kw)
    spec = server.client.chat.completions.create(messages=QUESTION, tool_choice="required",
                                                 extra_body={"speculative": speculative}, **kw)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) >= 1, message
    call = message.tool_calls[0]
    assert call.function.name == "GetWeather" and GetWeather.model_validate_json(call.function.arguments)
    for other in (plain, spec):  # speculation changes nothing: the same calls, in fewer passes
        assert [c.function for c in other.choices[0].message.tool_calls] == [c.function for c in message.tool_calls]
    assert spec.stats["target_passes"] < plain.stats["target_passes"]  # type: ignore[attr-defined]
    history = [*QUESTION, message, {"role": "tool", "tool_call_id": call.id,
                                    "content": json.dumps({"city": "Paris", "celsius": 18, "sky": "sunny"})}]
    final = server.client.chat.completions.create(messages=history, tool_choice="none", **kw)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None and answer.message.content.strip()


def test_streamed_tool_calls_are_assembled_by_the_client(server: Server) -> None:
    tools = [openai.pydantic_function_tool(GetWeather)]
    kw = dict(model=NAME, messages=QUESTION, tools=tools, tool_choice="required", max_tokens=120, temperature=0)
    whole = server.client.chat.completions.create(**kw).choices[0].message
    with server.client.chat.completions.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion().choices[0]
    assert events.count("tool_calls.function.arguments.delta") > 2 and "tool_calls.function.arguments.done" in events
    call = final.message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)  # the client parsed the strict tool's arguments
    assert [c.function.arguments for c in final.message.tool_calls] == [c.function.arguments for c in whole.tool_calls]
    assert final.finish_reason == "tool_calls"


def test_parse_with_a_pydantic_model(server: Server) -> None:
    r = server.client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                             response_format=Weather, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Weather)


def test_qwen_template_is_hermes_and_writes_the_history_as_trained() -> None:
    """The packaged Qwen2.5-Coder 0.5B's tokenizer and template, from its GGUF (the weights stay unread)."""
    tokenizer = gguf_tokenizer(read_metadata(open_reader(resolve_model("qwen2.5-coder-0.5b").path)))
    render = (lambda messages, tools: tokenizer.chat_text(messages, tools=tools))
    assert syntax_of(render) is HERMES
    tool = openai.pydantic_function_tool(GetWeather)["function"]
    tools = Tools((Function(tool["name"], tool["parameters"], tool.get("description"), True),), "required")
    history = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "GetWeather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    text = render(*conversation(history, tools, HERMES))
    assert '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text and '"name": "GetWeather"' in text.split("<|im_end|>")[0]


def test_qwen_calls_a_tool_in_its_own_syntax() -> None:
    """Qwen2.5-Coder 0.5B, told the tools by its own template: under `required` and a named function,
    with parallel calls allowed (OpenAI's default), its calls are <tool_call> special tokens around the
    JSON, read back into tool_calls, and the reply ends where the model ends it: one call, then "\n"
    and its end token (a grammar that allowed only another call after that line break made it call
    again until max_tokens); under `auto` it writes the call's JSON without the tags (as it does with
    no grammar at all): a bare call, read as one (tool_reply). Speculation changes none of them."""
    s = Server(quickdraft.load("qwen2.5-coder-0.5b"), max_batch=1)
    replies = {}
    named = {"type": "function", "function": {"name": "GetWeather"}}
    try:
        for key, choice in (("required", "required"), ("named", named), ("auto", "auto")):
            kw = dict(model=NAME, messages=QUESTION, tools=[openai.pydantic_function_tool(GetWeather)],
                      tool_choice=choice, max_tokens=80, temperature=0)
            replies[key] = [s.client.chat.completions.create(extra_body={"speculative": spec}, **kw).choices[0]
                            for spec in ({"method": "none"}, {"method": "ngram", "k": 8})]
    finally:
        s.stop()
    for plain, spec in (replies["required"], replies["named"]):
        assert plain.finish_reason == "tool_calls" and plain.message.content is None, plain.message
        assert [c.function.name for c in plain.message.tool_calls] == ["GetWeather"]
        assert GetWeather.model_validate_json(plain.message.tool_calls[0].function.arguments)
        assert [c.function for c in spec.message.tool_calls] == [c.function for c in plain.message.tool_calls]
    free, free_spec = replies["auto"]
    assert free.finish_reason == "tool_calls" and free.message.content is None, free.message
    assert [c.function.name for c in free.message.tool_calls] == ["GetWeather"]
    assert isinstance(json.loads(free.message.tool_calls[0].function.arguments), dict)
    assert [c.function for c in free_spec.message.tool_calls] == [c.function for c in free.message.tool_calls]


def test_qwen_1_5b_forced_single_tool_ends_with_the_calls_it_chose() -> None:
    """The issue's case on the 1.5B (the model people serve): `required` with parallel calls allowed
    ended in invented calls until max_tokens, the last one cut short and returned as a call."""
    s = Server(quickdraft.load("qwen2.5-coder-1.5b"), max_batch=1)
    try:
        reply = s.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "What is the weather in Tokyo?"}], temperature=0,
            tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", max_tokens=120).choices[0]
    finally:
        s.stop()
    assert reply.finish_reason == "tool_calls", reply.message
    assert [(c.function.name, json.loads(c.function.arguments)["city"]) for c in reply.message.tool_calls] == \
        [("GetWeather", "Tokyo")]
