"""The server's logprobs / top_logprobs, presence / frequency penalties and n > 1 (issue 36 item 4).

Oracles: the Python API with the same settings, plainly decoded (texts, logprobs to the bit: JSON
carries a float's repr); the tokenizer's own byte symbols (each token's bytes); the greedy token
being its position's likeliest; each choice i of a seeded request equal to a request of its own
seeded seed + i; the prefix cache's count of the prompt tokens each choice did not prefill.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from quickdraft.proposers.base import SpecConfig
from quickdraft.server.guards import ADMIT, Admission, QueueFull
from quickdraft.server.schemas import MAX_CHOICES
from quickdraft.spec.sampling import SamplingParams
from support.http import token_bytes
from support.server import NAME, Server

NGRAM = {"speculative": {"method": "ngram", "k": 4}}
PLAIN = SpecConfig("none")
MESSAGES = [{"role": "user", "content": "hello hello hello"}]
MAX_WAITING = 8  # with max_batch 4: the server holds 12 requests at once


@pytest.fixture(scope="module")
def server(llm) -> Server:
    s = Server(llm, max_batch=4, max_waiting=MAX_WAITING)
    yield s
    s.stop()


def test_chat_logprobs_are_openais_shape_and_plain_decodings(server: Server, llm) -> None:
    r = server.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body=NGRAM)
    alone = llm.generate(messages=MESSAGES, params=SamplingParams(max_new_tokens=12, logprobs=3), spec=PLAIN)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == alone.text and len(content) == len(alone.token_ids) > 0
    assert [c.logprob for c in content] == [lp.logprob for lp in alone.logprobs]
    assert [bytes(c.bytes) for c in content] == token_bytes(llm, alone.token_ids)
    for c, lp in zip(content, alone.logprobs):
        assert [t.logprob for t in c.top_logprobs] == [v for _, v in lp.top]
        assert [bytes(t.bytes) for t in c.top_logprobs] == token_bytes(llm, [i for i, _ in lp.top])
        assert c.top_logprobs[0].logprob == c.logprob and c.token == c.top_logprobs[0].token  # greedy: the likeliest
    chunks = list(server.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                                        logprobs=True, top_logprobs=3, stream=True, extra_body=NGRAM))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob, c.bytes) for c in streamed] == [(c.token, c.logprob, c.bytes) for c in content]
    plain = server.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_are_the_legacy_lists(server: Server, llm) -> None:
    r = server.client.completions.create(model=NAME, prompt="abc abc abd", max_tokens=10, temperature=0.7, seed=5,
                                         logprobs=2, extra_body=NGRAM)
    alone = llm.generate("abc abc abd", params=SamplingParams(temperature=0.7, seed=5, max_new_tokens=10, logprobs=2),
                         spec=SpecConfig("ngram", k=4))
    lp = r.choices[0].logprobs
    assert r.choices[0].text == alone.text
    assert lp.token_logprobs == [x.logprob for x in alone.logprobs]
    def spelled(ids: list[int]) -> list[str]:
        return [b.decode("utf-8", errors="replace") for b in token_bytes(llm, ids)]
    assert lp.tokens == spelled(alone.token_ids)
    for alternatives, x in zip(lp.top_logprobs, alone.logprobs, strict=True):
        expected: dict[str, float] = {}  # keyed by text: of alternatives that spell alike, the likeliest
        for text, (_, v) in zip(spelled([i for i, _ in x.top]), x.top):
            expected.setdefault(text, v)
        assert alternatives == expected and len(x.top) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(alone.text)


def test_penalties_are_exact_under_speculation_through_the_server(server: Server, llm) -> None:
    penalties = {"presence_penalty": -2.0, "frequency_penalty": -0.5}  # negative: the text repeats, drafts hit
    r = server.client.completions.create(model=NAME, prompt="hello hello hello", max_tokens=24, temperature=0,
                                         extra_body=NGRAM, **penalties)
    plain = llm.generate("hello hello hello", params=SamplingParams(max_new_tokens=24, **penalties), spec=PLAIN)
    unpenalized = llm.generate("hello hello hello", params=SamplingParams(max_new_tokens=24), spec=PLAIN)
    assert r.choices[0].text == plain.text != unpenalized.text
    assert r.model_extra["stats"]["accepted_tokens"] > 0  # drafts were verified and accepted


def test_n_choices_are_seeded_requests_sharing_the_prompts_prefill(server: Server, llm) -> None:
    prompt = "n choices: a prompt of its own, long enough to fill two of the prefix cache's blocks " * 2
    body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3, **NGRAM}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in r["choices"]]
    for i, text in enumerate(texts):
        alone = llm.generate(prompt, params=SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=10),
                             spec=SpecConfig("ngram", k=4))
        assert text == alone.text
    assert len(set(texts)) > 1
    cached = [c["stats"]["cached_tokens"] for c in r["choices"]]
    prompt_tokens = r["usage"]["prompt_tokens"]
    assert cached[0] == 0 and all(c >= prompt_tokens - 16 for c in cached[1:]), (cached, prompt_tokens)
    assert r["usage"]["completion_tokens"] == sum(c["stats"]["new_tokens"] for c in r["choices"])
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == texts


def test_n_choices_stream_each_with_its_index(server: Server) -> None:
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=3, n=2, logprobs=True)
    whole = server.client.chat.completions.create(**kw)
    chunks = list(server.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, logprobs, finished = ["", ""], [[], []], set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        logprobs[choice.index] += [c.logprob for c in choice.logprobs.content] if choice.logprobs else []
        if choice.finish_reason:
            finished.add(choice.index)
        assert chunk.id == chunks[0].id
    assert finished == {0, 1}
    assert texts == [c.message.content for c in whole.choices]
    assert logprobs == [[c.logprob for c in choice.logprobs.content] for choice in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


BAD = [  # (route, fields, param)
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": MAX_CHOICES + 1}, "n"),
    ("chat", {"n": 4 + MAX_WAITING + 1}, "n"),  # more than the server ever holds
]


@pytest.mark.parametrize("route, fields, param", BAD)
def test_bad_values_are_a_400_naming_the_field(server: Server, route: str, fields: dict, param: str) -> None:
    base = {"messages": MESSAGES} if route == "chat" else {"prompt": "hi"}
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", timeout=30,
                   json={"model": NAME, "max_tokens": 4, **base, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_published_schema_bounds_the_new_fields(server: Server) -> None:
    published = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = published[request]["properties"]
        assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, min(MAX_CHOICES, 4 + MAX_WAITING))
        for name in ("presence_penalty", "frequency_penalty"):
            assert (fields[name]["anyOf"][0]["minimum"], fields[name]["anyOf"][0]["maximum"]) == (-2, 2)
    top = published["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert (top["minimum"], top["maximum"]) == (0, 20)
    legacy = published["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]
    assert (legacy["minimum"], legacy["maximum"]) == (0, 20)


def test_a_request_for_n_choices_takes_n_places() -> None:
    """Admission (1 row, 2 waiting): n = 2 takes two places, so a third request fits and a fourth does not."""
    async def main() -> None:
        gate = asyncio.Event()

        async def route(scope, receive, send) -> None:
            scope[ADMIT](scope["choices"])
            await gate.wait()

        admission = Admission(route, frozenset({"/v1/completions"}), rows=1, waiting=2)

        def call(n: int):
            return admission({"type": "http", "path": "/v1/completions", "method": "POST", "choices": n}, None, None)
        held = [asyncio.create_task(call(2))]
        await asyncio.sleep(0)
        assert admission.inside == 2
        with pytest.raises(QueueFull):
            await call(2)
        held.append(asyncio.create_task(call(1)))
        await asyncio.sleep(0)
        assert admission.inside == 3
        with pytest.raises(QueueFull):
            await call(1)
        gate.set()
        await asyncio.gather(*held)
        assert admission.inside == 0
    asyncio.run(main())
