"""Issue 45, items 5 and 6: what a hostile client sends past the grammar library's limits, and
prompts that pass the length bound yet hold far more tokens than the context.

Schemas llguidance 1.9.1 compiles but fails on at their first steps (a pattern of a million
repetitions, an anyOf of 5,000 objects, a schema that is only a reference to itself or requires
itself with no end) and a tool's keyword it does not implement (`not`, with strict unset) answered
200 with cut-off JSON, empty content or the keyword ignored; each must be a 400 naming the field,
at compile time, and a GrammarError / ToolsError in the Python API. A 330 KB prompt was tokenized
whole before it was refused; the tokenizer must stop at a prefix that is past the context.

Oracles: the status, param and message of the answer; the characters handed to the tokenizer
(counted, not timed); the whole text's own tokenization for prompts that fit.
"""
from __future__ import annotations

import random
import time
from typing import Iterator

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer

import quickdraft
from quickdraft.errors import ContextTooLong
from quickdraft.proposers import SpecConfig
from quickdraft.requests.prompt import PREFIX_CHARS, PREFIX_SLACK, bounded
from quickdraft.server.requests import GRAMMAR_TIMEOUT_S
from quickdraft.structured.grammar import GrammarError
from quickdraft.structured.tools import ToolsError
from support.server import MAX_SEQ, NAME, Server
from tiny_tokenizer import tiny_llm_dir

LONG_TOKEN = "=" * 256  # one token of 256 bytes: the length bound then lets 2048 * 256 bytes through
USER = [{"role": "user", "content": "Answer as JSON"}]


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def _tool(parameters: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters, **extra}}


LIMITS = {  # schema -> what the 400 says
    "pattern": ({"type": "string", "pattern": "^a{1000000}$"}, "too many expressions"),
    "anyOf": ({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                          "additionalProperties": False} for i in range(5000)]}, "max is 2000"),
    "self": ({"$ref": "#"}, "allows no text"),
    "loop": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "allows no text"),
    "requires itself": ({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                            "required": ["next"]}}, "$ref": "#/$defs/node"}, "Too many items"),
    "nested": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {
        "type": "string", "pattern": "^a{1000000}$"}}}, "additionalProperties": False}, "too many expressions"),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    """The tiny model, its tokenizer given a 256-byte token (as SmolLM2 has an 81-byte one)."""
    path = tiny_llm_dir(tmp_path_factory.mktemp("limits") / "target", max_position_embeddings=MAX_SEQ)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(LONG_TOKEN, special=False, normalized=False)])
    tokenizer.save(str(path / "tokenizer.json"))
    loaded = quickdraft.load(str(path), spec=SpecConfig("ngram", k=4))
    assert loaded.tokenizer.bytes_per_token == len(LONG_TOKEN)
    return loaded


@pytest.fixture(scope="module")
def server(llm) -> Iterator[Server]:
    s = Server(llm, max_batch=2)
    yield s
    s.stop()


def _post(server: Server, route: str, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/{route}", json={"model": NAME, "max_tokens": 8, **body}, timeout=60)
    return r, time.monotonic() - start


# -- item 5: schemas past llguidance's limits -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LIMITS))
def test_a_schema_past_the_limits_is_a_400_naming_response_format(server: Server, name: str) -> None:
    """Old code: 200 with '"', '{' or '{"' (finish_reason grammar_dead_end), or '' (stop)."""
    schema, says = LIMITS[name]
    r, took = _post(server, "chat/completions", {"messages": USER, "response_format": _format(schema)})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_response_format", error
    assert says in error["message"] and "did not compile within" not in error["message"], error
    assert took < GRAMMAR_TIMEOUT_S


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_a_tool_past_the_limits_is_a_400_naming_its_parameters(server: Server, name: str) -> None:
    schema, says = LIMITS[name]
    r, took = _post(server, "chat/completions", {"messages": USER, "tools": [_tool(schema)], "tool_choice": "required"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "tools.0.function.parameters" and says in error["message"], error
    assert took < GRAMMAR_TIMEOUT_S


def test_a_tool_keyword_llguidance_does_not_implement_is_refused_unless_strict_is_false(server: Server) -> None:
    """`not` under tools with strict unset was dropped silently (old code: 200); response_format
    refuses it, and so do tools now, unless the tool says strict: false."""
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    for extra in ({}, {"strict": True}):
        r, _ = _post(server, "chat/completions", {"messages": USER, "tools": [_tool(schema, **extra)]})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "tools.0.function.parameters" and "Unimplemented keys" in error["message"], error
    r, _ = _post(server, "chat/completions", {"messages": USER, "tools": [_tool(schema, strict=False)]})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_the_python_api_raises_for_them_too(llm, name: str) -> None:
    schema, says = LIMITS[name]
    with pytest.raises(GrammarError, match=says):
        llm.generate("JSON:", response_format=_format(schema))
    with pytest.raises(ToolsError, match=says) as e:
        llm.generate(messages=USER, tools=[_tool(schema)], tool_choice="required")
    assert e.value.param == "tools.0.function.parameters"


def test_a_schema_within_the_limits_still_compiles_and_answers(server: Server) -> None:
    """The walk at compile time refuses nothing it should not: nested objects, optional keys, arrays."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                               "b": {"type": "array", "items": {"type": "integer", "maximum": 99}},
                                               "c": {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]}},
              "required": ["a"], "additionalProperties": False}
    r, _ = _post(server, "chat/completions", {"messages": USER, "response_format": _format(schema)})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"].startswith('{"a": "')


# -- item 6: prompts past the context, bounded tokenizer work -------------------------------------------------

def _counting(monkeypatch, llm) -> list[int]:
    """The length of every text the server hands the tokenizer."""
    seen: list[int] = []
    encode = llm.tokenizer.encode

    def counted(text: str, *args: bool) -> list[int]:
        seen.append(len(text))
        return encode(text, *args)

    monkeypatch.setattr(llm.tokenizer, "encode", counted)
    return seen


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_330_kb_prompt_is_refused_from_a_prefix(server: Server, llm, monkeypatch, route: str) -> None:
    """330 KB of text passes the length bound here (2048 tokens * 256 bytes) as it does SmolLM2's at a
    4,096 context; old code tokenized all of it (330k characters) before refusing it."""
    text = "".join(random.Random(0).choice("abcdefgh ") for _ in range(330_000))
    seen = _counting(monkeypatch, llm)
    body = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
    r, _ = _post(server, route, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert r.json()["error"]["param"] == ("prompt" if route == "completions" else "messages")
    assert 0 < sum(seen) <= 4 * PREFIX_CHARS * (MAX_SEQ + PREFIX_SLACK + len(LONG_TOKEN)) < len(text) // 4, seen


def test_a_long_prompt_that_fits_is_tokenized_whole(server: Server, llm, monkeypatch) -> None:
    """A 231 KB prompt of 1,800 tokens, half of them long, goes through the prefixes (some cutting a
    long token into 255 short ones) to the whole text, whose tokens it is answered on."""
    text = (LONG_TOKEN + "a") * 900
    expected = len(llm.tokenizer.encode(text))
    assert len(text) > 8 * PREFIX_CHARS * (MAX_SEQ + PREFIX_SLACK + len(LONG_TOKEN)) and expected < MAX_SEQ - 8
    r, _ = _post(server, "completions", {"prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["prompt_tokens"] == expected


def test_bounded_refuses_only_texts_past_the_context(llm) -> None:
    """Texts of every density around the context, long tokens cut by the prefixes: a text is refused
    only when its own tokens do not fit, and otherwise gets the whole text's tokens."""
    tokenizer, rng, context = llm.tokenizer, random.Random(1), 64
    refused = 0
    for _ in range(50):
        p, n = rng.choice([0.0, 0.02, 0.2, 0.5, 0.9]), rng.choice([rng.randint(1, 80), rng.randint(80, 1500)])
        text = "".join(LONG_TOKEN if rng.random() < p else rng.choice("ab =") for _ in range(n))
        whole = tokenizer.encode(text, False)
        try:
            ids = bounded(tokenizer, text, False, context)
        except ContextTooLong:
            assert len(whole) >= context, (p, len(text), len(whole))
            refused += 1
        else:
            assert ids == whole
    assert refused > 10  # the prefixes' refusal was tried, not only whole texts
