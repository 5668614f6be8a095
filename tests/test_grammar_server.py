"""response_format over HTTP: json_object and json_schema in chat and completions, streaming too.

Oracles: jsonschema's validator; the Python API's output for the same request (LLM.generate with
the same response_format); the streamed text against the whole one; 400s naming response_format.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

import quickdraft.server.requests as requests_module
from quickdraft.proposers import SpecConfig
from quickdraft.spec.sampling import SamplingParams
from support.server import NAME, Server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "rain": {"type": "boolean"},
                                           "days": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "integer", "minimum": 0, "maximum": 31}}},
          "required": ["city", "rain", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "The weather in Paris, as JSON"}]


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=4)
    yield s
    s.stop()


@pytest.mark.parametrize("speculative", [{"method": "none"}, {"method": "ngram", "k": 6},
                                         {"method": "ngram-tree", "k": 8}, {"method": "draft", "k": 3}])
def test_chat_json_schema_validates_and_equals_the_python_api(server: Server, llm, speculative) -> None:
    r = server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=200, temperature=0,
                                              response_format=FORMAT, extra_body={"speculative": speculative})
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), SCHEMA)
    spec = SpecConfig(**{"draft_model": llm.spec.draft_model, **speculative})
    expected = llm.generate(messages=USER, params=SamplingParams(max_new_tokens=200), spec=spec,
                            response_format=FORMAT)
    assert content == expected.text and expected.finish_reason == "stop"
    chunks = list(server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=200, temperature=0,
                                                        response_format=FORMAT, stream=True,
                                                        extra_body={"speculative": speculative}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_json_object_and_sampled_json_schema(server: Server) -> None:
    for seed in range(3):
        r = server.client.completions.create(model=NAME, prompt="JSON:", max_tokens=200, temperature=1.0, seed=seed,
                                             extra_body={"response_format": FORMAT})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = server.client.completions.create(model=NAME, prompt="JSON:", max_tokens=300, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # a random model may write a long object: what it wrote is the start of one
        assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")


BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}},
     "compiled"),
    ({"type": "json_schema"}, "required with type json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "required with type json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "pattern"),
    ({"type": "xml"}, "text"),
]


@pytest.mark.parametrize("fmt,says", BAD)
def test_a_bad_response_format_is_a_400_naming_it(server: Server, fmt: dict, says: str) -> None:
    for route, base in (("chat/completions", {"messages": USER}), ("completions", {"prompt": "hi"})):
        r = httpx.post(f"{server.url}/v1/{route}", timeout=30,
                       json={"model": NAME, "max_tokens": 4, "response_format": fmt, **base})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("response_format") and says in error["message"], error
        assert error["code"] == ("invalid_response_format" if error["param"] == "response_format" else None), error


def test_a_schema_slow_to_compile_is_a_400_and_stalls_no_one(server: Server, llm, monkeypatch) -> None:
    """Compiling runs on the server's grammar threads under a time limit: a request whose schema
    takes too long gets a 400, and a plain request sent meanwhile is answered before it."""
    real = requests_module.constraint_of

    def slow(*args):
        time.sleep(3.0)
        return real(*args)

    monkeypatch.setattr(requests_module, "GRAMMAR_TIMEOUT_S", 1.0)
    monkeypatch.setattr(requests_module, "constraint_of", slow)
    answered: dict[str, float] = {}

    def plain() -> None:
        time.sleep(0.2)
        server.client.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=0)
        answered["plain"] = time.perf_counter()

    other = threading.Thread(target=plain)
    other.start()
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, response_format=FORMAT)
    refused = time.perf_counter()
    other.join()
    assert e.value.body["param"] == "response_format" and "did not compile within 1 s" in e.value.body["message"]
    assert answered["plain"] < refused


def test_the_openai_clients_parse_with_a_pydantic_model(server: Server) -> None:
    """client.chat.completions.parse sends the model's strict JSON schema and parses the reply."""
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=8)
        rain: bool
        days: list[int] = Field(max_length=3)

    r = server.client.chat.completions.parse(model=NAME, messages=USER, max_tokens=200, temperature=0,
                                             response_format=Weather)
    parsed = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(parsed, Weather)
    assert parsed == Weather.model_validate_json(r.choices[0].message.content)
