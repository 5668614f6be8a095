"""The OpenAI-compatible server, over real HTTP: uvicorn on 127.0.0.1, the official `openai` client
for the happy paths and raw httpx for the malformed ones.

Oracles: the Python API's output for the same request alone (greedy and seeded sampling), the
server's own output for a request run alone vs under concurrency, /metrics for freed rows.
"""
from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import openai
import pytest

import quickdraft
from quickdraft import kernels
from quickdraft.proposers import EACH, Committed, Draft
from quickdraft.proposers.registry import PROPOSERS, Registration
from quickdraft.spec.sampling import SamplingParams
from support.server import MAX_SEQ, NAME, PROMPTS, Server, alone, serve_process, stream_text, wait_for

SPECS = [{"method": "none"}, {"method": "ngram", "k": 2}, {"method": "ngram", "k": 8},
         {"method": "draft", "k": 3}, {"method": "ngram", "k": 4, "adaptive": False}, {"method": "draft", "k": 1},
         {}, {"method": "ngram", "k": 1}]


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4)
    yield s
    s.stop()


# -- the happy paths, with the openai client ----------------------------------------------------------------

def test_models_health_and_metrics_format(server: Server) -> None:
    assert [m.id for m in server.client.models.list()] == [NAME]
    health = httpx.get(f"{server.url}/health").json()
    assert health == {"status": "ok", "weights": "float32", "kernel": kernels.kernel_info().isa}
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("quickdraft_requests_running", "quickdraft_requests_waiting", "quickdraft_tokens_per_pass",
                 "quickdraft_acceptance_rate", "quickdraft_step_seconds_bucket"):
        assert name in metrics.text


def test_completion_equals_the_python_api(server: Server, llm) -> None:
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert r.choices[0].text == alone(llm, PROMPTS[0], 40, {"method": "none"})
    assert r.choices[0].finish_reason in ("stop", "length")
    n_prompt = len(llm.tokenizer.encode(PROMPTS[0]))
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 40


def test_chat_streaming_equals_non_streaming_and_the_api(server: Server, llm) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30,
                                                        temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    expected = llm.generate(messages=messages, params=SamplingParams(max_new_tokens=30)).text
    assert whole.choices[0].message.content == streamed == expected
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_resent_history_reuses_the_cached_prefix(server: Server, dirs) -> None:
    """A chat client's second turn resends the first and its answer: the server reports the cached
    part (usage.prompt_tokens_details.cached_tokens, OpenAI's field, in the final stream chunk too)
    and /metrics counts it, and the answer is the one a model with no prefix cache gives."""
    history = [{"role": "user", "content": "Tell me about the sea and the ships on it, please. " * 4}]
    first = server.client.chat.completions.create(model=NAME, messages=history, max_tokens=24, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the harbours?"}]
    before = server.metrics().get("quickdraft_prefix_cache_hit_tokens_total", 0.0)
    second = server.client.chat.completions.create(model=NAME, messages=history, max_tokens=24, temperature=0)
    chunks = list(server.client.chat.completions.create(model=NAME, messages=history, max_tokens=24, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens  # the first turn's prompt, at least
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    cold = quickdraft.load(str(dirs[0]), prefix_cache_mb=0)
    expected = cold.generate(messages=history, params=SamplingParams(max_new_tokens=24)).text
    assert second.choices[0].message.content == expected == "".join(c.choices[0].delta.content or ""
                                                                    for c in chunks if c.choices)
    metrics = server.metrics()
    assert metrics["quickdraft_prefix_cache_hit_tokens_total"] - before >= 2 * cached
    assert 0 < metrics["quickdraft_prefix_cache_bytes"] <= metrics["quickdraft_prefix_cache_budget_bytes"]
    assert 0 < metrics["quickdraft_kv_blocks_used"] <= metrics["quickdraft_kv_blocks_reserved"]


def test_sse_wire_format_ends_with_done(server: Server) -> None:
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["usage"]["completion_tokens"] > 0


def test_stop_string_cuts_the_text(server: Server, llm) -> None:
    full = alone(llm, PROMPTS[0], 60, {"method": "none"})
    stop = full[10:13]
    assert stop and full.index(stop) >= 10
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    text, chunks = stream_text(server.client, PROMPTS[0], 60, {}, temperature=0, stop=stop)
    assert text == full[:full.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_per_request_speculation(server: Server) -> None:
    def stats(spec: dict) -> dict:
        body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0, "speculative": spec}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()

    off, on, fixed = stats({"method": "none"}), stats({"method": "ngram", "k": 8, "adaptive": False}), stats({"k": 5, "adaptive": False})
    assert off["choices"][0]["text"] == on["choices"][0]["text"] == fixed["choices"][0]["text"]
    assert off["stats"]["drafted_tokens"] == 0 and on["stats"]["drafted_tokens"] > 0
    assert len(fixed["stats"]["acceptance_by_position"]) == 5  # all 5 offered tokens verified
    # a proposer's own options, as the registry names them: a 16-token suffix never recurs here
    long_only = stats({"method": "ngram", "ngram_min": 16, "ngram_max": 16})
    assert long_only["choices"][0]["text"] == off["choices"][0]["text"]
    assert long_only["stats"]["drafted_tokens"] == 0
    # whole numbers written as floats are the schema's integers, options included (schemathesis found
    # 13.0 refused)
    as_floats = stats({"method": "ngram", "ngram_min": 16.0, "ngram_max": 16.0, "k": 8.0})
    assert as_floats["choices"][0]["text"] == off["choices"][0]["text"] and as_floats["stats"]["drafted_tokens"] == 0


def test_eight_concurrent_streams_equal_each_alone(server: Server, llm) -> None:
    """8 parallel streaming requests (4 rows: half of them wait) with different prompts and proposers,
    greedy and seeded sampling mixed: each gets exactly what it gets alone."""
    jobs = [(PROMPTS[i], SPECS[i], {"temperature": 0} if i % 3 else {"temperature": 0.9, "seed": 100 + i})
            for i in range(8)]
    solo = [stream_text(server.client, p, 48, s, **kw)[0] for p, s, kw in jobs]
    for (p, s, kw), text in zip(jobs, solo):
        if kw["temperature"] == 0:
            assert text == alone(llm, p, 48, s), (p, s)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: stream_text(server.client, job[0], 48, job[1], **job[2])[0], jobs))
    assert together == solo
    m = server.metrics()
    assert m["quickdraft_drafted_tokens_total"] > 0 and m["quickdraft_accepted_tokens_total"] > 0
    assert m["quickdraft_requests_running"] == 0


# -- robustness -------------------------------------------------------------------------------------------

def test_disconnect_cancels_and_frees_the_row(server: Server, llm) -> None:
    before = server.metrics().get('quickdraft_requests_total{finish_reason="cancelled"}', 0.0)
    body = {"model": NAME, "prompt": "y", "max_tokens": MAX_SEQ - 10, "temperature": 0, "stream": True,
            "speculative": {"method": "none"}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        wait_for(lambda: server.metrics()["quickdraft_requests_running"] == 1)
    # the client is gone: its row is freed before its 2038 tokens (greedy from "y" finds no end-of-text)
    wait_for(lambda: server.metrics()["quickdraft_requests_running"] == 0)
    m = server.metrics()
    assert m['quickdraft_requests_total{finish_reason="cancelled"}'] == before + 1
    assert m["quickdraft_generated_tokens_total"] < 10_000
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert r.choices[0].text == alone(llm, PROMPTS[2], 8, {"method": "none"})


BAD = {
    # name: (body or raw bytes, status, fragment of the error message)
    "invalid json": (b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    "not an object": (b'[1, 2]', 400, ""),
    "missing prompt": ({"model": NAME}, 400, "prompt"),
    "missing model": ({"prompt": "hi"}, 400, "model"),
    "max_tokens wrong type": ({"model": NAME, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    "negative max_tokens": ({"model": NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    "temperature out of range": ({"model": NAME, "prompt": "hi", "temperature": 7}, 400, "temperature"),
    "top_p zero": ({"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    "n too large": ({"model": NAME, "prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16"),
    "unknown model": ({"model": "gpt-5", "prompt": "hi"}, 404, "not served"),
    "prompt too long": ({"model": NAME, "prompt": list(range(3, 200)) * 11}, 400, "context"),
    "max_tokens past context": ({"model": NAME, "prompt": "hi", "max_tokens": MAX_SEQ}, 400, "context holds"),
    "token id out of range": ({"model": NAME, "prompt": [1, 99999]}, 400, "token ids"),
    "empty prompt": ({"model": NAME, "prompt": ""}, 400, "prompt: String should have at least 1 character"),
    "unknown proposer": ({"model": NAME, "prompt": "hi", "speculative": {"method": "magic"}}, 400, "valid names"),
    "k too large": ({"model": NAME, "prompt": "hi", "speculative": {"k": 999}}, 400,
                    "speculative.k: Input should be less than or equal to 32"),
    "no head for this model": ({"model": NAME, "prompt": "hi", "speculative": {"method": "head"}}, 400,
                               "no draft head ships"),
    "unknown speculative field": ({"model": NAME, "prompt": "hi", "speculative": {"kk": 2}}, 400, "kk"),
    "option out of range": ({"model": NAME, "prompt": "hi", "speculative": {"ngram_max": 17}}, 400,
                            "speculative.ngram_max: Input should be less than or equal to 16"),
    "options at odds": ({"model": NAME, "prompt": "hi", "speculative": {"ngram_min": 5}}, 400,
                        "ngram_min <= ngram_max, found 5, 4"),
    "option of wrong type": ({"model": NAME, "prompt": "hi", "speculative": {"ngram_min": "2"}}, 400,
                             "speculative.ngram_min"),
    "stop wrong type": ({"model": NAME, "prompt": "hi", "stop": 5}, 400, "stop"),
    "penalty out of range": ({"model": NAME, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
}


@pytest.mark.parametrize("case", BAD)
def test_malformed_requests_get_openai_shaped_4xx(server: Server, case: str) -> None:
    body, status, fragment = BAD[case]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"]


def test_chat_errors_and_unknown_route(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    message = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}).json()["error"]["message"]
    assert message.startswith("POST /v1/embeddings is not an endpoint of this server; it serves ")
    assert "POST /v1/chat/completions" in message and "GET /v1/models" in message and "/static" not in message
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="hi")


@pytest.mark.parametrize("fault", ["proposer", "target pass"])
def test_a_failing_request_does_not_affect_the_others(server: Server, llm, monkeypatch, fault: str) -> None:
    """A request whose proposer raises, or whose draft makes the batch's target pass raise (a token
    id past the vocabulary), gets a 500; concurrent requests get what they get alone."""
    class Exploding:
        group = EACH

        def __init__(self, ctx) -> None:
            pass

        def propose(self, k: int) -> Draft:  # first called right after the prompt's pass
            if fault == "target pass":
                return Draft([10**6], None)
            raise RuntimeError("proposer exploded")

        def commit(self, step: Committed) -> None:
            pass

    monkeypatch.setitem(PROPOSERS, "exploding", Registration("exploding", Exploding))
    with ThreadPoolExecutor(3) as pool:
        good = [pool.submit(stream_text, server.client, PROMPTS[i], 40, {"method": "ngram", "k": 4}, temperature=0)
                for i in (3, 4)]
        bad = pool.submit(lambda: httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "boom", "max_tokens": 40, "speculative": {"method": "exploding"}}))
        message = bad.result().json()["error"]["message"]
        assert bad.result().status_code == 500 and message.startswith("generation failed")
        assert "exploded" in message or fault == "target pass"
        for i, future in zip((3, 4), good):
            assert future.result()[0] == alone(llm, PROMPTS[i], 40, {"method": "none"})
    assert server.metrics()['quickdraft_requests_total{finish_reason="error"}'] >= 1


EXTREMES = [{"temperature": 1e-38}, {"temperature": 1e-38, "top_p": 1e-46}, {"temperature": 0.7, "top_p": 1e-46},
            {"temperature": 5e-324, "seed": 7}]


def test_extreme_sampling_values_are_served_and_harm_no_one(server: Server, llm) -> None:
    """Issue 16: temperature 1e-38 (or top_p 1e-46) passed validation, made NaN probabilities and
    failed the engine step: a 500 for the sender, "generation failed" for the whole batch. Sent
    while a greedy stream runs: every request gets a 200, the extreme ones decode as greedy (one
    token is left possible) and the stream gets exactly what it gets alone."""
    errors = lambda: server.metrics().get('quickdraft_requests_total{finish_reason="error"}', 0.0)
    errors_before = errors()
    expected = alone(llm, PROMPTS[6], 200, {"method": "none"})
    expected_extreme = alone(llm, PROMPTS[2], 30, {"method": "none"})
    stream = server.client.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=200, stream=True,
                                              temperature=0, extra_body={"speculative": {"method": "none"}})
    first = next(stream).choices[0].text  # its row is in the batch; 200 tokens keep it there meanwhile

    def send(sampling: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": PROMPTS[2], "max_tokens": 30, **sampling})

    with ThreadPoolExecutor(len(EXTREMES)) as pool:
        replies = list(pool.map(send, EXTREMES))
    text = first + "".join(c.choices[0].text for c in stream if c.choices)
    for sampling, r in zip(EXTREMES, replies):
        assert r.status_code == 200, (sampling, r.text)
        assert r.json()["choices"][0]["text"] == expected_extreme, sampling
    assert text == expected
    assert errors() == errors_before


# -- the command line server and SIGTERM --------------------------------------------------------------------

def test_serve_command_drains_in_flight_requests_on_sigterm(dirs) -> None:
    with serve_process(dirs) as (proc, url):
        body = {"model": NAME, "prompt": "abc abc", "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", "the in-flight stream was cut instead of finished"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        assert first and proc.wait(60) == 0
        assert "Traceback" not in proc.stdout.read().decode()
