"""Structured output on the real default model (SmolLM2-135M-Instruct): json_schema answers validate,
speculation under the schema gives constrained plain decoding's text, and the grammar's forced
tokens make fewer target passes than tokens. Slow: run with `pytest -m slow`.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.proposers import SpecConfig

pytestmark = pytest.mark.slow

SCHEMAS = [
    ("Describe a person called Ada, who is 36, as JSON.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("Give the weather in Paris as JSON.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                       "temperature_c": {"type": "number"},
                                       "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
      "required": ["city", "temperature_c", "sky"], "additionalProperties": False}),
]


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load()


@pytest.mark.parametrize("prompt,schema", SCHEMAS)
def test_json_schema_answers_validate_and_speculation_changes_nothing(llm: quickdraft.LLM, prompt: str,
                                                                      schema: dict) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": prompt}]
    params = SamplingParams(max_new_tokens=120)
    plain = llm.generate(messages=messages, params=params, spec=SpecConfig(method="none"), response_format=fmt)
    spec = llm.generate(messages=messages, params=params, spec=SpecConfig(method="ngram", k=8), response_format=fmt)
    assert plain.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), schema)
    assert spec.text == plain.text
    assert spec.stats.target_passes < plain.stats.target_passes  # forced keys and punctuation: drafted


VARIED = [  # (prompt, schema): nesting, arrays of objects, enums, unions, bounds, patterns, formats
    ("List two fruits with their colors as JSON.",
     {"type": "object", "properties": {"fruits": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "color": {"enum": ["red", "yellow", "green", "orange", "purple"]}},
         "required": ["name", "color"], "additionalProperties": False}}},
      "required": ["fruits"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON.",
     {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0,
                                                                                    "maximum": 1}},
      "required": ["answer", "confidence"], "additionalProperties": False}),
    ("Give a US phone number and a zip code as JSON.",
     {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["phone", "zip"], "additionalProperties": False}),
    ("Three prime numbers as a JSON array.",
     {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "integer", "minimum": 2, "maximum": 100}}),
    ("Describe a book as JSON, with its author.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "author": {"type": "object", "properties": {
                                           "name": {"type": "string", "maxLength": 30},
                                           "born": {"type": ["integer", "null"]}},
                                           "required": ["name", "born"], "additionalProperties": False},
                                       "pages": {"type": "integer", "minimum": 1, "maximum": 5000}},
      "required": ["title", "author", "pages"], "additionalProperties": False}),
    ("Give a date and a time for a meeting as JSON.",
     {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                       "room": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 99},
                                                          {"const": "remote"}]}},
      "required": ["date", "room"], "additionalProperties": False}),
    ("Rate this movie from 1 to 5 as JSON, with tags.",
     {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]},
                                       "tags": {"type": "array", "maxItems": 4,
                                                "items": {"type": "string", "maxLength": 12}}},
      "required": ["stars", "tags"], "additionalProperties": False}),
]


@pytest.mark.parametrize("prompt,schema", VARIED, ids=[f"schema{i}" for i in range(len(VARIED))])
def test_varied_schemas_validate_plain_and_speculative(llm: quickdraft.LLM, prompt: str, schema: dict) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": prompt}]
    params = SamplingParams(max_new_tokens=200)
    plain = llm.generate(messages=messages, params=params, spec=SpecConfig(method="none"), response_format=fmt)
    assert plain.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), schema)
    for spec in (SpecConfig(method="ngram", k=8), SpecConfig(method="ngram-tree", k=8)):
        assert llm.generate(messages=messages, params=params, spec=spec, response_format=fmt).text == plain.text
    sampled = llm.generate(messages=messages, params=SamplingParams(max_new_tokens=200, temperature=0.8, seed=1),
                           spec=SpecConfig(method="ngram", k=8), response_format=fmt)
    assert sampled.finish_reason == "stop", sampled.text
    jsonschema.validate(json.loads(sampled.text), schema)
