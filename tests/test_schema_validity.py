"""Every json_schema answer validates: 50 varied schemas and prompts on the real default model
(SmolLM2-135M-Instruct), greedy with prompt lookup's chains and sampled with its trees, each
output checked by the `jsonschema` package (formats too); and on the packaged Qwen2.5-Coder 1.5B,
greedy (its steps are ~7x SmolLM2's: sampled too would pass this module's ~3 minutes). Slow: run
with `pytest -m slow`.

The 50 are ten subjects, each in five shapes (flat with bounded numbers, enums and a boolean,
an array of objects, nested objects with a nullable field, optional fields with a pattern and a
date, an array at the top); every string and array is bounded, so a complete answer always fits
the token budget.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jsonschema
import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.proposers import SpecConfig

pytestmark = pytest.mark.slow

Schema = dict[str, Any]


def text(n: int = 24) -> Schema:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def strict(properties: Schema, required: list[str] | None = None) -> Schema:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


# subject -> (its noun, a numeric field and range, an enum field and its values, a list field's item)
SUBJECTS: dict[str, tuple[str, str, tuple[int, int], str, list[str], str]] = {
    "book": ("a novel", "pages", (1, 2000), "genre", ["fiction", "mystery", "fantasy", "history"], "character"),
    "city": ("Lisbon", "population_thousands", (1, 40000), "climate", ["mild", "hot", "cold", "dry"], "landmark"),
    "dog": ("a family dog", "age_years", (0, 25), "size", ["small", "medium", "large"], "trick"),
    "laptop": ("a laptop for students", "ram_gb", (2, 128), "os", ["windows", "macos", "linux"], "port"),
    "recipe": ("pancakes", "minutes", (1, 300), "difficulty", ["easy", "medium", "hard"], "ingredient"),
    "planet": ("Mars", "moons", (0, 100), "kind", ["rocky", "gas giant", "ice giant"], "feature"),
    "song": ("a summer pop song", "bpm", (40, 220), "mood", ["happy", "sad", "calm", "angry"], "instrument"),
    "company": ("a small bakery", "employees", (1, 500), "sector", ["food", "retail", "tech", "services"],
                "product"),
    "trip": ("a weekend in Rome", "budget_eur", (50, 5000), "transport", ["train", "plane", "car", "bus"],
             "stop"),
    "student": ("a physics student", "year", (1, 6), "level", ["bachelor", "master", "doctorate"], "course"),
}


def flat(noun: str, num: str, bounds: tuple[int, int], enum: str, values: list[str], item: str) -> Schema:
    return strict({"name": text(), num: integer(*bounds), enum: {"enum": values}, "recommended": {"type": "boolean"}})


def listing(noun: str, num: str, bounds: tuple[int, int], enum: str, values: list[str], item: str) -> Schema:
    return strict({"name": text(), f"{item}s": {"type": "array", "minItems": 1, "maxItems": 3, "items": strict(
        {item: text(20), "rank": integer(1, 10)})}})


def nested(noun: str, num: str, bounds: tuple[int, int], enum: str, values: list[str], item: str) -> Schema:
    return strict({"name": text(), "details": strict({num: integer(*bounds), enum: {"enum": values},
                                                      "note": {"anyOf": [text(30), {"type": "null"}]}}),
                   "score": {"type": "number", "minimum": 0, "maximum": 10}})


def optional(noun: str, num: str, bounds: tuple[int, int], enum: str, values: list[str], item: str) -> Schema:
    return strict({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "name": text(),
                   "since": {"type": "string", "format": "date"}, num: integer(*bounds),
                   "tags": {"type": "array", "maxItems": 3, "items": text(12)}}, required=["code", "name"])


def top_array(noun: str, num: str, bounds: tuple[int, int], enum: str, values: list[str], item: str) -> Schema:
    return {"type": "array", "minItems": 2, "maxItems": 4, "items": strict({item: text(20), enum: {"enum": values}})}


SHAPES: dict[str, tuple[Callable[..., Schema], str]] = {  # shape -> (schema maker, the prompt's request)
    "flat": (flat, "Describe {noun} as JSON: its name, {num}, {enum} and whether you recommend it."),
    "listing": (listing, "List up to three {item}s of {noun}, ranked, as JSON."),
    "nested": (nested, "Give the details of {noun} as JSON, with a score out of 10."),
    "optional": (optional, "Make a catalogue record for {noun} as JSON with a code like ABC-12."),
    "top_array": (top_array, "Give a JSON array of {item}s of {noun}, each with its {enum}."),
}

CASES = [(f"{subject}-{shape}", make(*fields), prompt.format(noun=fields[0], num=fields[1], enum=fields[3],
                                                                 item=fields[5]))
         for subject, fields in SUBJECTS.items() for shape, (make, prompt) in SHAPES.items()]
MAX_NEW = 200


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load()


def test_fifty_distinct_schemas_each_valid_and_compiled(llm: quickdraft.LLM) -> None:
    assert len(CASES) == 50 and len({json.dumps(s, sort_keys=True) for _, s, _ in CASES}) == 50
    for name, schema, _ in CASES:
        jsonschema.Draft202012Validator.check_schema(schema)
        llm.constraint({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})


def check(name: str, schema: Schema, out: quickdraft.Completion) -> str | None:
    """None when `out` is a complete JSON text its schema accepts, formats included; else why not."""
    try:
        assert out.finish_reason == "stop", f"finish reason {out.finish_reason}"
        jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(json.loads(out.text))
    except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        return f"{name}: {str(e).splitlines()[0]}; output {out.text!r}"
    return None


def answers(llm: quickdraft.LLM, greedy: bool) -> list[quickdraft.Completion]:
    """The 50 requests at once, 8 threads: the engine decodes them in batches, as a server would;
    greedy with prompt lookup's chains, or sampled with its trees."""
    spec = SpecConfig(method="ngram" if greedy else "ngram-tree", k=8)

    def answer(i: int) -> quickdraft.Completion:
        name, schema, prompt = CASES[i]
        params = SamplingParams(max_new_tokens=MAX_NEW, **({} if greedy else {"temperature": 0.8, "seed": 100 + i}))
        return llm.generate(messages=[{"role": "user", "content": prompt}], params=params, spec=spec,
                            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(answer, range(len(CASES))))


def assert_all_valid(outs: list[quickdraft.Completion], what: str) -> None:
    failures = [why for (name, schema, _), out in zip(CASES, outs) if (why := check(name, schema, out))]
    assert not failures, f"{len(failures)} of {len(CASES)} outputs invalid ({what}):\n" + "\n".join(failures)
    assert sum(out.stats.drafted_tokens for out in outs) > 0  # the premise: speculation ran


@pytest.mark.parametrize("mode", ["greedy, ngram chains", "sampled, ngram trees"])
def test_every_json_schema_output_validates(llm: quickdraft.LLM, mode: str) -> None:
    assert_all_valid(answers(llm, mode.startswith("greedy")), mode)


def test_every_json_schema_output_of_the_qwen_1_5b_validates() -> None:
    """The same 50 on the packaged Qwen2.5-Coder 1.5B, greedy (its steps are ~7x SmolLM2's)."""
    assert_all_valid(answers(quickdraft.load("qwen2.5-coder-1.5b"), True), "Qwen2.5-Coder 1.5B, greedy")
