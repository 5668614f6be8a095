"""gpt-oss's harmony end to end: a tiny random gpt-oss with a harmony tokenizer and template
(tiny_harmony.py) through the Python API and the server, and the server's routes over replies
scripted token by token (a stand-in engine worker), as gpt-oss writes them.

Random weights write random text, so the live model is steered with logit_bias: an end token it
is pushed to at once, or, under a forced call's grammar, an analysis that ends soon and a call
rather than more analysis or a preamble. Oracles: the ids that end a generation (none past
<|return|>, <|call|> or <|endoftext|>; <|end|> six times over); the Python API's reading of the same
greedy generation for the server's answer, whole and streamed; plain decoding for speculation's
tokens; jsonschema for a call's arguments; for scripted replies, their reasoning, answer and call
stated by hand, the openai package's types for Responses events and the anthropic SDK's own stream
accumulation; the template's prompt for the reasoning effort and the history the routes render.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

import quickdraft
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.proposers import SpecConfig
from quickdraft.server.routes import chat, completions, messages, responses_api
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured import harmony
from support.messages_api import sse as anthropic_sse
from support.responses_api import sse as responses_sse
from support.routes import StandInWorker, bare_app
from support.server import NAME, Server
from tiny_harmony import harmony_gguf, harmony_llm_dir, token
from tiny_tokenizer import tiny_llm_dir

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "Weather in Oslo?"}]
END, RETURN, CALL, MESSAGE = (token(t) for t in ("<|end|>", "<|return|>", "<|call|>", "<|message|>"))
# The random model's greedy path steered: its analysis ends soon (<|end|>), then a call rather than
# more analysis ('a', id 100, begins that channel's name) or a preamble (<|message|> after commentary;
# where the grammar allows nothing else it is still taken)
STEER = {END: 3.0, 100: -1.0, MESSAGE: -100.0}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    return quickdraft.load(harmony_llm_dir(tmp_path_factory.mktemp("harmony")), spec=SpecConfig(method="none"))


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=2)
    yield s
    s.stop()


def no_markers(*texts: str | None) -> bool:
    return not any(marker in (text or "") for text in texts for marker in harmony.MARKERS)


# -- the live model ------------------------------------------------------------------------------------------

def test_end_goes_on_and_return_call_and_end_of_text_end_the_turn(llm, server) -> None:
    pushed = llm.generate(messages=USER, params=SamplingParams(max_new_tokens=6, logit_bias={END: 100.0}))
    assert (pushed.token_ids, pushed.finish_reason) == ([END] * 6, "length")
    for end in (RETURN, CALL, 0):  # 0: <|endoftext|>; config.json names <|return|> alone
        ended = llm.generate(messages=USER, params=SamplingParams(max_new_tokens=6, logit_bias={end: 100.0}))
        assert (ended.token_ids, ended.finish_reason) == ([], "stop"), end
    for end, finish, tokens in ((END, "length", 6), (RETURN, "stop", 0), (CALL, "stop", 0)):
        r = server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=6, temperature=0,
                                                  logit_bias={str(end): 100})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == (finish, tokens)


def test_a_gpt_oss_gguf_speaks_harmony_and_ends_as_its_generation_config_says(tmp_path) -> None:
    """The GGUF names <|return|> alone its end (as llama.cpp's converter writes gpt-oss's); the family
    adds <|call|> and <|endoftext|>, and the rebuilt tokenizer's markers make its template harmony."""
    gguf = quickdraft.load(str(harmony_gguf(tmp_path / "gpt-oss.gguf")), spec=SpecConfig(method="none"))
    assert gguf.tokenizer.eos_token_ids == {RETURN, CALL, 0} and gguf.tool_syntax().channels
    for end in (RETURN, CALL, 0):
        ended = gguf.generate(messages=USER, params=SamplingParams(max_new_tokens=6, logit_bias={end: 100.0}))
        assert (ended.token_ids, ended.finish_reason) == ([], "stop"), end
    pushed = gguf.generate(messages=USER, params=SamplingParams(max_new_tokens=6, logit_bias={END: 100.0}))
    assert (pushed.token_ids, pushed.finish_reason) == ([END] * 6, "length")


def test_a_forced_call_after_reasoning_reads_out_and_speculation_changes_nothing(llm) -> None:
    kw = dict(messages=USER, tools=TOOLS, tool_choice="required", params=SamplingParams(max_new_tokens=200,
                                                                                        logit_bias=STEER))
    plain = llm.generate(**kw)
    assert plain.finish_reason == "tool_calls" and plain.reasoning and plain.content == "", plain.text
    [call] = plain.tool_calls
    assert call.name == "get_weather" and plain.message["reasoning_content"] == plain.reasoning
    jsonschema.validate(call.arguments, WEATHER)
    assert plain.text.startswith("<|channel|>analysis<|message|>") and no_markers(plain.reasoning)
    spec = llm.generate(spec=SpecConfig("ngram", k=4), **kw)
    assert (spec.token_ids, spec.tool_calls[0].arguments) == (plain.token_ids, call.arguments)


def test_the_python_stream_reads_the_reply_as_generate_reads_it_whole(llm) -> None:
    """LLM.stream's chunks carry what each adds to the reply: joined, their reasoning, content and
    call pieces are generate's reading of the same greedy generation, no marker in any; the raw
    text stays whole in `text`."""
    kw = dict(messages=USER, tools=TOOLS, tool_choice="required", params=SamplingParams(max_new_tokens=200,
                                                                                        logit_bias=STEER))
    whole = llm.generate(**kw)
    chunks = list(llm.stream(**kw))
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.reasoning for c in chunks) == whole.reasoning and whole.reasoning
    assert "".join(c.content for c in chunks) == whole.content and no_markers(*(c.content for c in chunks))
    pieces = [p for c in chunks for p in c.tool_calls]
    assert [p.name for p in pieces if p.name is not None] == [c.name for c in whole.tool_calls]
    assert json.loads("".join(p.arguments for p in pieces if p.index == 0)) == whole.tool_calls[0].arguments
    # read as it comes, not at the end: the reasoning before the call, the call's pieces over chunks
    first_call = next(i for i, c in enumerate(chunks) if c.tool_calls)
    assert any(c.reasoning for c in chunks[:first_call]) and sum(bool(c.tool_calls) for c in chunks) > 1
    # a prompt's text is all content, its finish reason the engine's
    prompt = list(llm.stream(prompt="Weather", params=SamplingParams(max_new_tokens=5)))
    assert [c.content for c in prompt] == [c.text for c in prompt] and prompt[-1].finish_reason == "length"
    assert not any(c.reasoning or c.tool_calls for c in prompt)


def test_the_server_answers_as_the_python_api_reads_whole_and_streamed(llm, server) -> None:
    api = llm.generate(messages=USER, tools=TOOLS, tool_choice="required",
                       params=SamplingParams(max_new_tokens=200, logit_bias=STEER))
    kw = dict(model=NAME, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              logit_bias={str(t): b for t, b in STEER.items()})
    answer = server.client.chat.completions.create(**kw)
    whole = answer.choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == api.stats.reasoning_tokens
    assert 0 < api.stats.reasoning_tokens < api.stats.new_tokens
    assert whole.message.model_extra["reasoning_content"] == api.reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [(c.name, c.arguments) for c in api.tool_calls]
    reasoning, arguments, finish = "", "", None
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        assert no_markers(delta.content, delta.model_extra.get("reasoning_content"))
        reasoning += delta.model_extra.get("reasoning_content") or ""
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, json.loads(arguments), finish) == (api.reasoning, api.tool_calls[0].arguments, "tool_calls")


def test_the_reasoning_effort_reaches_the_prompt_and_a_bad_one_is_a_400(llm, server) -> None:
    for effort in ("low", "high"):
        r = server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, reasoning_effort=effort)
        assert r.usage.prompt_tokens == len(llm.prompt_ids(messages=USER, reasoning_effort=effort))
    assert len(llm.prompt_ids(messages=USER, reasoning_effort="low")) != len(llm.prompt_ids(messages=USER))
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": USER,
                                                               "reasoning_effort": "max"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


# -- the routes over scripted replies ---------------------------------------------------------------------------

THOUGHT = "The user asks about Oslo. It is sunny there."
ANSWER = "It is sunny in Oslo."
ANSWERED = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
ARGS = '{"city": "Oslo", "days": 2}'
CALLED = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather" \
         f"<|channel|>commentary json<|message|>{ARGS}"


class ScriptedWorker(StandInWorker):
    """Every request is answered with `script`'s tokens, `size` a step, then `finish` (a turn's end
    token is the engine's to cut: the script stops before it)."""

    def __init__(self, ids: list[int], size: int, finish: str = "stop") -> None:
        super().__init__(context=4096)
        self.ids, self.size, self.finish = ids, size, finish

    def submit(self, request, sink, make_proposer=None) -> None:
        self.submitted.append(request)
        prompt = len(request.prompt_ids)
        for at in range(0, len(self.ids), self.size):
            sink(TokenEvent(self.ids[at:at + self.size], None,
                            GenerationStats(prompt_tokens=prompt, new_tokens=min(at + self.size, len(self.ids)))))
        sink(TokenEvent([], self.finish, GenerationStats(prompt_tokens=prompt, new_tokens=len(self.ids))))


def scripted(llm, script: str, size: int = 1, finish: str = "stop", routes: tuple = (chat, responses_api, messages)):
    app = bare_app(llm, *routes)
    ids = llm.tokenizer.encode(script, add_special_tokens=False)
    app.state.served = dataclasses.replace(app.state.served, worker=ScriptedWorker(ids, size, finish))
    return app


def post(app, path: str, payload: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.post(path, json=payload)
    return asyncio.run(go())


def chat_deltas(text: str) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


SIZES = [1, 3, 1000]  # token by token, a few at a time, all at once


@pytest.mark.parametrize("size", SIZES)
def test_chat_keeps_reasoning_out_of_the_content_whole_and_streamed(llm, size: int) -> None:
    app = scripted(llm, ANSWERED, size)
    body = {"model": NAME, "messages": USER}
    whole = ChatCompletion.model_validate(post(app, "/v1/chat/completions", body).json()).choices[0]
    assert whole.message.content == ANSWER and whole.message.model_extra["reasoning_content"] == THOUGHT
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    deltas = chat_deltas(post(app, "/v1/chat/completions", {**body, "stream": True}).text)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    assert (content, reasoning, deltas[-1]["finish_reason"]) == (ANSWER, THOUGHT, "stop")
    assert all(no_markers(d["delta"].get("content"), d["delta"].get("reasoning_content")) for d in deltas)


@pytest.mark.parametrize("size", SIZES)
def test_a_call_with_its_recipient_in_the_role_reads_as_a_tool_call(llm, size: int) -> None:
    app = scripted(llm, CALLED, size)
    body = {"model": NAME, "messages": USER, "tools": TOOLS}
    whole = post(app, "/v1/chat/completions", body).json()["choices"][0]
    [call] = whole["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert (whole["message"]["content"], whole["message"]["reasoning_content"], whole["finish_reason"]) == \
        (None, THOUGHT, "tool_calls")
    deltas = chat_deltas(post(app, "/v1/chat/completions", {**body, "stream": True}).text)
    pieces = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert pieces[0]["function"]["name"] == "get_weather" and "id" in pieces[0]
    assert "".join(p["function"]["arguments"] for p in pieces) == ARGS
    assert deltas[-1]["finish_reason"] == "tool_calls"
    cut = scripted(llm, CALLED[:-5], size, "length")  # out of tokens mid-arguments: no call handed on
    cut_whole = post(cut, "/v1/chat/completions", body).json()["choices"][0]
    assert (cut_whole["finish_reason"], "tool_calls" in cut_whole["message"]) == ("length", False)


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("script,kinds", [(ANSWERED, ["reasoning", "message"]), (CALLED, ["reasoning", "function_call"])])
def test_responses_put_a_reasoning_item_before_the_answer_whole_and_streamed(llm, script: str, kinds) -> None:
    app = scripted(llm, script, 2)
    body = {"model": NAME, "input": "Weather in Oslo?", "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "reasoning": {"effort": "low", "summary": "auto"}}
    whole = Response.model_validate(post(app, "/v1/responses", body).json())
    assert [item.type for item in whole.output] == kinds and whole.status == "completed"
    assert whole.output[0].content[0].text == THOUGHT and whole.output[0].summary == []
    assert whole.reasoning.effort == "low"
    events = responses_sse(post(app, "/v1/responses", {**body, "stream": True}).text)
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole.model_dump(exclude_none=True)["output"])
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT and len(deltas) > 1


@pytest.mark.parametrize("size", SIZES)
def test_usage_counts_the_reasoning_tokens_whole_streamed_and_in_responses(llm, size: int) -> None:
    """The analysis body's tokens, its header and markers not; the same whole, streamed and in a response."""
    thought = len(llm.tokenizer.encode(THOUGHT, add_special_tokens=False))
    app = scripted(llm, ANSWERED, size)
    body = {"model": NAME, "messages": USER}
    whole = post(app, "/v1/chat/completions", body).json()["usage"]
    assert whole["completion_tokens_details"] == {"reasoning_tokens": thought}
    assert whole["completion_tokens"] == len(llm.tokenizer.encode(ANSWERED, add_special_tokens=False)) > thought
    events = post(app, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    last = json.loads([e for e in events.text.split("\n\n") if e.startswith("data: {")][-1].removeprefix("data: "))
    assert last["usage"] == whole
    answer = post(app, "/v1/responses", {"model": NAME, "input": "Weather in Oslo?"}).json()
    assert answer["usage"]["output_tokens_details"] == {"reasoning_tokens": thought}
    app = scripted(llm, ANSWERED, size, routes=(completions,))
    plain = post(app, "/v1/completions", {"model": NAME, "prompt": "Weather in Oslo?"}).json()["usage"]
    assert plain["completion_tokens_details"] == {"reasoning_tokens": 0}  # a completion's text is not read


def test_messages_put_a_thinking_block_first_unless_thinking_is_disabled(llm) -> None:
    from anthropic.lib.streaming._messages import accumulate_event

    app = scripted(llm, ANSWERED, 2)
    body = {"model": NAME, "max_tokens": 100, "messages": USER}
    whole = post(app, "/v1/messages", body).json()
    assert whole["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                {"type": "text", "text": ANSWER}]
    text = post(app, "/v1/messages", {**body, "stream": True}).text
    snapshot, buffers = None, {}
    for data in anthropic_sse([block + "\n\n" for block in text.strip().split("\n\n")]):
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=buffers)
    assert [block.model_dump(exclude_none=True) for block in snapshot.content] == whole["content"]
    hidden = post(app, "/v1/messages", {**body, "thinking": {"type": "disabled"}}).json()
    assert hidden["content"] == [{"type": "text", "text": ANSWER}]
    stopped = post(app, "/v1/messages", {**body, "stop_sequences": ["in Oslo"]}).json()  # found in the raw text
    assert stopped["content"][1] == {"type": "text", "text": "It is sunny "}
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "in Oslo")


def test_the_reasoning_a_client_sends_back_is_written_before_the_call_it_led_to(llm) -> None:
    """The same turn as each route's clients echo it: the reasoning goes before the call in the prompt."""
    app = scripted(llm, ANSWERED)
    written = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather"
    chat_turn = [*USER, {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    items = [{"type": "message", "role": "user", "content": USER[0]["content"]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGS},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    anthropic_turn = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": THOUGHT, "signature": "x"},
        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": json.loads(ARGS)}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    anthropic_tools = [{"name": "get_weather", "description": "A forecast", "input_schema": WEATHER}]
    prompts = []
    for path, payload in (("/v1/chat/completions", {"messages": chat_turn, "tools": TOOLS}),
                          ("/v1/responses", {"input": items, "tools": tools}),
                          ("/v1/messages", {"messages": anthropic_turn, "tools": anthropic_tools, "max_tokens": 9})):
        assert post(app, path, {"model": NAME, **payload}).status_code == 200, path
        prompts.append(llm.tokenizer.hf.decode(app.state.served.worker.submitted[-1].prompt_ids))
        assert written in prompts[-1], path
    assert prompts[0] == prompts[1] == prompts[2]


def test_each_route_names_its_own_reasoning_effort_field(llm, tmp_path) -> None:
    app = scripted(llm, ANSWERED)
    for path, payload, param in (
            ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "max"}, "reasoning_effort"),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
            ("/v1/messages", {"messages": USER, "max_tokens": 9, "output_config": {"effort": "max"}},
             "output_config.effort")):
        answer = post(app, path, {"model": NAME, **payload})
        error = answer.json().get("error", {})
        assert answer.status_code == 400 and error.get("param") == param, (path, answer.json())
    high = post(app, "/v1/messages", {"model": NAME, "messages": USER, "max_tokens": 9,
                                      "output_config": {"effort": "high"}})
    assert high.status_code == 200
    assert "Reasoning: high" in llm.tokenizer.decode(app.state.served.worker.submitted[-1].prompt_ids)
    other = quickdraft.load(str(tiny_llm_dir(tmp_path / "chatml")))  # a template that takes no effort
    refused = post(bare_app(other, chat), "/v1/chat/completions", {"model": NAME, "messages": USER,
                                                                   "reasoning_effort": "low"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    assert "takes no reasoning effort" in refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "unsupported_parameter"  # as OpenAI answers it
