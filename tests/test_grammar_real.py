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
