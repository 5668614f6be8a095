"""The server's parts alone (issue 33): each route module mounted on a bare FastAPI app over a
stand-in engine worker (the tiny random model for the tokenizer and the checks), request
preparation's refusals, and the streaming module over events made by hand; plus the one chat
rendering the cluster's front shares with the app (issue 32) and the RoPE note of a prompt past the
context (issue 31).

Oracles: the ids the route submits (the chat template's, with the request's tools), the Python
API's own ContextTooLong message, the engine worker's cancels, the usage of the stats sent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import pytest
from fastapi import FastAPI

import quickdraft
from quickdraft.cluster.asgi import call_app
from quickdraft.cluster.digests import prompt_digests
from quickdraft.cluster.ingress import Ingress
from quickdraft.engine.batch import Request
from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.errors import ContextTooLong
from quickdraft.requests.text import TextAssembler
from quickdraft.server import responses as out
from quickdraft.server.choices import Choice
from quickdraft.server.prompts import Prompts
from quickdraft.server.routes import chat, completions, health, messages, models, responses_api
from quickdraft.server.streaming import Answer, stream, whole
from quickdraft.spec.sampling import SamplingParams
from support.routes import CONTEXT, NAME, FakeReplicas, ask, bare_app, body, start
from tiny_tokenizer import tiny_llm_dir

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


def call(app: FastAPI, path: str, payload: dict[str, Any] | None = None) -> httpx.Response:
    """POST the payload, or GET without one."""
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.request("POST" if payload else "GET", path, json=payload or None)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    return quickdraft.load(str(tiny_llm_dir(tmp_path_factory.mktemp("routes") / "tiny", max_position_embeddings=512)))


# -- each route module alone ------------------------------------------------------------------------------

def test_the_models_route_alone_lists_the_model_and_publishes_401_only_with_a_key(llm) -> None:
    app = bare_app(llm, models)
    assert call(app, "/v1/models").json()["data"] == [{"id": NAME, "object": "model", "created": 0,
                                                           "owned_by": "quickdraft"}]
    assert "401" not in app.openapi()["paths"]["/v1/models"]["get"]["responses"]
    keyed = bare_app(llm, models, api_keys=("k",))
    assert "401" in keyed.openapi()["paths"]["/v1/models"]["get"]["responses"]


def test_the_health_route_alone_names_the_weights_and_the_metrics_route_renders_them(llm) -> None:
    app = bare_app(llm, health)
    answer = call(app, "/health").json()
    assert answer["status"] == "ok" and answer["weights"] == llm.model.weight_format and answer["kernel"]
    metrics = call(app, "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "quickdraft_prefix_cache_hit_tokens" in metrics.text


def test_the_chat_route_alone_submits_the_templates_ids_of_the_conversation(llm) -> None:
    app = bare_app(llm, chat)
    response = call(app, "/v1/chat/completions", {"model": NAME, "messages": USER, "max_tokens": 3})
    assert response.status_code == 200, response.text
    [request] = app.state.served.worker.submitted
    expected = llm.tokenizer.encode(llm.tokenizer.chat_text(USER), add_special_tokens=False)
    assert request.prompt_ids == expected and request.params.max_new_tokens == 3
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    assert call(app, "/v1/completions", {"model": NAME, "prompt": "hi"}).status_code == 404  # not mounted


def test_request_preparation_refuses_before_the_engine_with_a_400_naming_the_field(llm) -> None:
    app = bare_app(llm, completions, context=64)
    cases = [({"prompt": list(range(3, 67))}, 400, "prompt", "context_length_exceeded"),
             ({"prompt": "hi", "max_tokens": 64}, 400, "max_tokens", "context_length_exceeded"),
             ({"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias", None),
             ({"prompt": [999]}, 400, "prompt", None),
             ({"prompt": "hi", "n": 5}, 400, "n", None),  # 2 rows + 2 waiting: 4 places
             ({"prompt": "hi", "speculative": {"method": "nope"}}, 400, "speculative", "invalid_speculation"),
             ({"model": "other", "prompt": "hi"}, 404, "model", "model_not_found")]
    for fields, status, param, code in cases:
        response = call(app, "/v1/completions", {"model": NAME, **fields})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (status, param, code), (fields, error)
    assert app.state.served.worker.submitted == []  # none reached the engine
    fitting = {"model": NAME, "prompt": list(range(3, 50)), "max_tokens": 17}  # 47 + 17: the whole context
    assert call(app, "/v1/completions", fitting).status_code == 200


# -- issue 31: the server's refusal carries the model's RoPE note, as the Python API's does -------------------

def test_a_prompt_past_a_dynamic_ntk_context_is_refused_with_the_python_apis_message(tmp_path: Path) -> None:
    llm = quickdraft.load(str(tiny_llm_dir(tmp_path / "dynamic", "llama-dynamic")))
    context = llm.model.config.max_position_embeddings
    assert context == 48
    note = llm.model.config.context_note(context)
    assert note.startswith(" (dynamic NTK RoPE: past max_position_embeddings")
    prompt = " ".join(["cat"] * context)
    with pytest.raises(ContextTooLong) as refused:
        llm.generate(prompt, params=SamplingParams(max_new_tokens=1))
    app = bare_app(llm, completions, chat, context=context)
    error = call(app, "/v1/completions", {"model": NAME, "prompt": prompt}).json()["error"]
    assert error["message"] == str(refused.value) and error["param"] == "prompt"
    budget = call(app, "/v1/completions", {"model": NAME, "prompt": "cat", "max_tokens": context}).json()["error"]
    assert budget["param"] == "max_tokens" and note in budget["message"]
    long_text = "x" * 100_000  # refused from its length alone, before the tokenizer
    error = call(app, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": long_text}]})
    assert "at least" in error.json()["error"]["message"] and note in error.json()["error"]["message"]


def test_a_prompt_past_a_plain_context_carries_no_note(llm) -> None:
    """The negative control: a context the engine sets (not the model's RoPE) says nothing more."""
    app = bare_app(llm, completions, context=32)
    message = call(app, "/v1/completions", {"model": NAME, "prompt": list(range(3, 35))}).json()["error"]["message"]
    assert message == ("the prompt has 32 tokens but the context holds 32; expected at most 31 so at least one "
                       "token can be generated")


# -- issue 32: the cluster's front routes a chat by the prompt the replica runs, tools included --------------

def test_a_tools_bearing_chats_routing_digests_are_those_of_the_prompt_the_route_submits(llm) -> None:
    app = bare_app(llm, chat)
    payload = {"model": NAME, "messages": USER, "tools": TOOLS, "max_tokens": 2}
    assert call(app, "/v1/chat/completions", payload).status_code == 200
    [request] = app.state.served.worker.submitted
    replicas = FakeReplicas([[start(), body(b"{}")]])
    ask(Ingress(replicas, Prompts(llm.tokenizer), 1 << 20, CONTEXT), "POST", "/v1/chat/completions", payload)
    forwarded, digests = replicas.calls[0]
    assert digests and digests == prompt_digests(request.prompt_ids)
    without_tools = llm.tokenizer.encode(llm.tokenizer.chat_text(USER), add_special_tokens=False)
    assert prompt_digests(without_tools) != digests  # the premise: tools change the prompt's blocks
    # the ids go with the call, and the replica's app submits them without rendering or tokenizing again
    assert_submitted_as_forwarded(llm, chat, forwarded, request.prompt_ids)
    # forwarded ids are checked as given ones: the scope's ids past the vocabulary are a 400, not a crash
    bad = dataclasses.replace(forwarded, prompt_ids=(llm.model.config.vocab_size,))
    assert asyncio.run(collect(call_app(bare_app(llm, chat), bad)))[0]["status"] == 400
    # a completion's one text prompt is forwarded too; ids the client gave are its own, not forwarded
    text, given = FakeReplicas([[start(), body(b"{}")]] * 2), {"model": NAME, "prompt": [1, 2, 3]}
    ingress = Ingress(text, Prompts(llm.tokenizer), 1 << 20, CONTEXT)
    ask(ingress, "POST", "/v1/completions", {"model": NAME, "prompt": "once upon a time"})
    ask(ingress, "POST", "/v1/completions", given)
    assert list(text.calls[0][0].prompt_ids) == llm.tokenizer.encode("once upon a time", add_special_tokens=True)
    assert text.calls[1][0].prompt_ids is None


def assert_submitted_as_forwarded(llm: quickdraft.LLM, route: Any, forwarded: Any, ids: list[int]) -> None:
    """The front's call carries `ids`, and a replica's app (only `route`) submits them without
    rendering or tokenizing the prompt again."""
    assert list(forwarded.prompt_ids) == ids
    replica = bare_app(llm, route)
    served = replica.state.served
    refuse = AssertionError("the replica rendered or tokenized a prompt the front had tokenized")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("encode", "chat_text"):
            patch.setattr(served.prompts, name, lambda *a, **k: (_ for _ in ()).throw(refuse))
        sent = asyncio.run(collect(call_app(replica, forwarded)))
    assert sent[0]["status"] == 200 and served.worker.submitted[0].prompt_ids == ids


WEATHER = TOOLS[0]["function"]


@pytest.mark.parametrize("path, payload, route", [
    ("/v1/messages", {"model": NAME, "max_tokens": 2, "system": "Be brief.", "messages": USER}, messages),
    ("/v1/messages", {"model": NAME, "max_tokens": 2, "messages": USER,
                      "tools": [{"name": WEATHER["name"], "description": WEATHER["description"],
                                 "input_schema": WEATHER["parameters"]}]}, messages),
    ("/v1/responses", {"model": NAME, "max_output_tokens": 2, "instructions": "Be brief.",
                       "input": USER[0]["content"]}, responses_api),
    ("/v1/responses", {"model": NAME, "max_output_tokens": 2, "input": USER[0]["content"],
                       "tools": [{"type": "function", **WEATHER}]}, responses_api),
], ids=["messages-system", "messages-tools", "responses-instructions", "responses-tools"])
def test_the_front_tokenizes_a_messages_or_responses_request_once_for_its_replica(llm, path: str, payload: dict,
                                                                                  route: Any) -> None:
    """The Messages and Responses routes answer as chats: the front renders their prompt (system
    text or tools included; both at once pass the tiny model's context) as the route does, routes
    by it and forwards its ids; a response that continues a stored one is rendered where the store
    is, on the replica."""
    app = bare_app(llm, route)
    assert call(app, path, payload).status_code == 200
    [request] = app.state.served.worker.submitted
    replicas = FakeReplicas([[start(), body(b"{}")]] * 2)
    ingress = Ingress(replicas, Prompts(llm.tokenizer), 1 << 20, CONTEXT)
    ask(ingress, "POST", path, payload)
    forwarded, digests = replicas.calls[0]
    assert digests == prompt_digests(request.prompt_ids)
    assert_submitted_as_forwarded(llm, route, forwarded, request.prompt_ids)
    if path == "/v1/responses":
        ask(ingress, "POST", path, {**payload, "previous_response_id": "resp_0"})
        assert replicas.calls[1][0].prompt_ids is None


async def collect(messages: Any) -> list[dict[str, Any]]:
    return [m async for m in messages]


# -- the streaming module over events made by hand --------------------------------------------------------------

def answer_of(llm: quickdraft.LLM, params: list[SamplingParams], cancelled: list[str],
              events: list[tuple[int, TokenEvent] | None]) -> Answer:
    """An answer of len(params) chat choices whose events are `events`, cancels recorded."""
    queue: asyncio.Queue = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    tokenizer = llm.tokenizer
    choices = [Choice(i, Request([1, 2, 3], p), TextAssembler(tokenizer, p).feed, "chat", tokenizer.token_bytes)
               for i, p in enumerate(params)]
    return Answer("chat", NAME, choices, queue, [None] * len(params), cancelled.append)


def sent(chunks: list[str]) -> Iterator[dict[str, Any]]:
    for chunk in chunks:
        assert chunk.startswith("data: ") and chunk.endswith("\n\n")
        if chunk != out.SSE_DONE:
            yield json.loads(chunk.removeprefix("data: "))


def test_the_stream_ends_with_the_usage_of_every_choice_and_cached_tokens(llm) -> None:
    ids = llm.tokenizer.encode("a b", add_special_tokens=False)
    last = [GenerationStats(prompt_tokens=20, cached_tokens=16, new_tokens=len(ids)),
            GenerationStats(prompt_tokens=20, cached_tokens=16, new_tokens=1)]
    events = [(0, TokenEvent(ids)), (1, TokenEvent(ids[:1], "length", last[1])), (0, TokenEvent([], "stop", last[0]))]
    cancelled: list[str] = []
    answer = answer_of(llm, [SamplingParams(), SamplingParams()], cancelled, events)

    async def read() -> list[str]:
        return [chunk async for chunk in stream(answer, include_usage=True)]
    chunks = asyncio.run(read())
    assert chunks[-1] == out.SSE_DONE
    *choice_chunks, usage = list(sent(chunks))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 20, "completion_tokens": len(ids) + 1, "total_tokens": 21 + len(ids),
        "prompt_tokens_details": {"cached_tokens": 16}, "completion_tokens_details": {"reasoning_tokens": 0}}
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks] == [None, "length", "stop"]
    assert cancelled == []  # the engine ended both itself


def test_a_stop_string_cancels_its_choice_and_a_closed_stream_cancels_the_rest(llm) -> None:
    ids = llm.tokenizer.encode("a b c d", add_special_tokens=False)
    events = [(0, TokenEvent(ids)), (1, TokenEvent(ids))]
    cancelled: list[str] = []
    answer = answer_of(llm, [SamplingParams(stop=("c",)), SamplingParams()], cancelled, events)

    async def first_two() -> list[str]:
        chunks = stream(answer, include_usage=False)
        read = [await chunks.__anext__(), await chunks.__anext__()]
        await chunks.aclose()  # the client went away
        return read
    stopped, other = sent(asyncio.run(first_two()))
    assert stopped["choices"][0]["finish_reason"] == "stop" and "c" not in stopped["choices"][0]["delta"]["content"]
    assert other["choices"][0]["finish_reason"] is None
    assert cancelled == [answer.choices[0].request.id, answer.choices[1].request.id]


def test_a_whole_answer_whose_client_left_is_a_499_and_cancels_its_choices(llm) -> None:
    cancelled: list[str] = []
    answer = answer_of(llm, [SamplingParams()], cancelled, [])

    async def gone() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def answered() -> int:
        return (await whole(answer, SimpleNamespace(receive=gone))).status_code
    assert asyncio.run(answered()) == 499
    assert cancelled == [answer.choices[0].request.id]
