"""Token origins on the wire: the "quickdraft" field of each stream chunk (docs/server.md, "Token
origins") against the stream's own usage, text and statistics, with a stop string cutting a step's
tokens; the published schema's description of it; and the playground's routes (the page itself is
tested in a browser by tests/test_playground.py).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

import quickdraft
from quickdraft.engine.batch import EngineConfig
from quickdraft.proposers import SpecConfig
from quickdraft.server import BackgroundServer, ServerConfig
from tiny_tokenizer import tiny_llm_dir

NAME = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """The draft model is the target itself: every draft is accepted whole."""
    target = tiny_llm_dir(tmp_path_factory.mktemp("stream") / "target", max_position_embeddings=512)
    llm = quickdraft.load(str(target), spec=SpecConfig("draft", k=4, draft_model=str(target)))
    s = BackgroundServer(llm, ServerConfig(NAME, llm.spec, EngineConfig(max_batch=2, max_seq_len=512)))
    yield s
    s.stop()


def stream(server: BackgroundServer, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "abc abc", "max_tokens": 60, "temperature": 0, "stream": True,
            "speculative": {"adaptive": False}, **body}) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check_origins(chunks: list[dict]) -> Counter:
    tokens = [t for c in chunks for t in c["quickdraft"]["tokens"]]
    final = chunks[-1]
    assert len(tokens) == final["usage"]["completion_tokens"] == final["stats"]["new_tokens"]
    for c in chunks:  # each token's text: together, the chunk's text
        assert "".join(t["text"] for t in c["quickdraft"]["tokens"]) == c["choices"][0]["text"]
    passes = [c["quickdraft"]["pass"] for c in chunks]
    assert passes == sorted(passes) and passes[-1] == final["stats"]["target_passes"]
    ext = final["quickdraft"]
    assert [a / d if d else 0.0 for a, d in zip(ext["accepted_at"], ext["drafted_at"])] == \
        final["stats"]["acceptance_by_position"]
    return Counter(t["origin"] for t in tokens)


def test_each_stream_chunk_says_where_its_tokens_came_from(server: BackgroundServer) -> None:
    chunks = stream(server)
    kinds = check_origins(chunks)
    assert kinds["target"] == 1 and kinds["recovered"] == 0  # the prompt's pass, then whole drafts
    assert kinds["accepted"] == chunks[-1]["stats"]["accepted_tokens"] and kinds["bonus"] > 0
    # cut at a stop string in the middle: the marks end with the text
    text = "".join(c["choices"][0]["text"] for c in chunks)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = stream(server, stop=[stop])
    assert cut[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in cut) == text[:text.index(stop)]
    check_origins(cut)
    whole = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "abc abc", "max_tokens": 60, "temperature": 0}).json()
    assert whole["choices"][0]["text"] == text and "quickdraft" not in whole  # streams only


def test_accepted_tokens_name_the_part_that_drafted_them(server: BackgroundServer) -> None:
    """lookup-draft (prompt lookup, else the draft model, here the target itself): each accepted
    token names its part (tests/test_lookup_draft.py has both parts' tokens in one answer), and
    their counts are the accepted tokens; a one-part proposer names none
    (its tokens are the request's method's). The text is plain greedy decoding's either way."""
    plain = stream(server, speculative={"method": "none"})
    text = "".join(c["choices"][0]["text"] for c in plain)
    by: dict[str, Counter] = {}
    for method in ("lookup-draft", "draft"):
        chunks = stream(server, speculative={"method": method, "adaptive": False})
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        check_origins(chunks)
        tokens = [t for c in chunks for t in c["quickdraft"]["tokens"]]
        assert all(t["source"] is None for t in tokens if t["origin"] not in ("accepted", "branch"))
        by[method] = Counter(t["source"] for t in tokens if t["origin"] in ("accepted", "branch"))
        assert sum(by[method].values()) == chunks[-1]["stats"]["accepted_tokens"] > 0
    # the draft model is the target: it wins the hybrid's choice as soon as its agreement is known
    assert "draft" in by["lookup-draft"] and set(by["lookup-draft"]) <= {"ngram", "draft"}
    assert set(by["draft"]) == {None}


def test_the_schema_documents_the_field_and_the_playground_is_served(server: BackgroundServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    event = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    origin = event["schema"]["anyOf"][0]["properties"]["quickdraft"]["properties"]["tokens"]["items"]
    assert origin["properties"]["origin"]["enum"] == ["accepted", "branch", "recovered", "bonus", "target"]
    assert "source" in origin["properties"]
    assert "/" not in schema["paths"] and "/playground/config" not in schema["paths"]
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in ("/static/playground.js", "/static/playground.css"):
        assert src in page.text and httpx.get(f"{server.url}{src}").status_code == 200
    config = httpx.get(f"{server.url}/playground/config").json()
    assert config["model"] == NAME and config["speculative"] == {"method": "draft", "k": 4}
    assert {"none", "ngram", "draft"} <= set(config["methods"]) and config["context"] == 512
