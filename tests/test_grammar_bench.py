"""`bench specbench`'s json_extraction group: documents in, JSON out under each one's schema, every
row constrained (plain too), the grammar's own time reported.

Oracles: jsonschema's meta-schema and llguidance's compiler for the shipped schemas; the forced
opening of each schema's JSON in the output of a random model (which would never write it
unconstrained); the report's definitions recomputed from its records; a tiny random model and the
tiny byte-level tokenizer, made in the test (never a download).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.bench.questions import OWN_FILES, bench_questions, load_questions
from quickdraft.bench.specbench import _quickdraft_turn, response_format, run_conversation
from quickdraft.cli import main
from quickdraft.proposers import SpecConfig
from quickdraft.structured.grammar import constrain, grammar_text
from support.grammar import vocabulary
from tiny_tokenizer import tiny_llm_dir

GROUP = "json_extraction"


def subschemas(schema: Any) -> Iterator[dict]:
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from subschemas(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from subschemas(value)


def has(schema: dict, kind: str) -> bool:
    parts = list(subschemas(schema))[1:]  # below the top
    return {
        "nested object": any(s.get("type") == "object" for s in parts),
        "array of objects": any(s.get("type") == "array" and s.get("items", {}).get("type") == "object" for s in parts),
        "enum": any("enum" in s for s in parts),
        "bounded number": any(s.get("type") in ("number", "integer") and ("minimum" in s or "maximum" in s)
                              for s in parts),
        "pattern": any("pattern" in s for s in parts),
        "optional field": any(s.get("type") == "object" and set(s["required"]) < set(s["properties"])
                              for s in subschemas(schema)),
        "nullable": any(s.get("type") == "null" for s in parts),
    }[kind]


def test_the_group_ships_varied_valid_schemas_that_compile() -> None:
    questions = load_questions(OWN_FILES[GROUP])
    assert 20 <= len(questions) <= 30 and {q.group for q in questions} == {GROUP}
    assert len({q.question_id for q in questions}) == len(questions)
    assert bench_questions([GROUP], None) == (questions, [OWN_FILES[GROUP]])  # no Spec-Bench file needed
    for q in questions:
        jsonschema.Draft202012Validator.check_schema(q.schema)
        assert len(q.turns) == 1 and json.dumps(q.schema) in q.turns[0]  # the prompt gives the schema
        constrain(vocabulary(), grammar_text(response_format(q.schema)))  # strict: every keyword implemented
    for kind in ("nested object", "array of objects", "enum", "bounded number", "pattern", "optional field",
                 "nullable"):
        assert sum(has(q.schema, kind) for q in questions) >= 3, kind


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llm_dir(tmp_path_factory.mktemp("json") / "model", max_position_embeddings=4096)


def test_every_row_answers_under_the_schema_and_the_grammar_is_timed(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["bench", "specbench", "--model", str(model_dir), "--groups", GROUP, "--limit", "2",
                 "--max-new-tokens", "12", "--methods", "plain,ngram", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["summary"]["groups"]) == [GROUP] and res["failures"] == []
    for q in res["questions"]:
        for label, run in q["runs"].items():
            assert run["identical_to_plain"] is True, label  # constrained speculation == constrained plain
            assert run["grammar_s"] > 0 and run["grammar_s"] == pytest.approx(sum(t["grammar_s"] for t in run["turns"]))
    for label, s in res["summary"]["overall"].items():
        runs = [q["runs"][label] for q in res["questions"]]
        assert s["grammar_s"] == pytest.approx(sum(r["grammar_s"] for r in runs))
        assert s["grammar_share"] == pytest.approx(s["grammar_s"] / s["wall_s"])
        assert s["grammar_ms_per_pass"] == pytest.approx(1e3 * s["grammar_s"] / s["target_passes"])
        # the decode speedup: each turn's tokens after its first, over the engine's time from the first to the last
        decode = [(r["new_tokens"] - len(r["turns"])) / sum(t["decode_s"] for t in r["turns"]) for r in runs]
        assert all(0 < t["decode_s"] < t["wall_s"] for r in runs for t in r["turns"])
        assert [r["decode_tokens_per_s"] for r in runs] == pytest.approx(decode)
        plain = [q["runs"]["plain"]["decode_tokens_per_s"] for q in res["questions"]]
        assert s["decode_speedup"] == pytest.approx(sum(decode) / sum(plain))
    report = (out / "report.md").read_text()
    assert "### Under a JSON schema" in report and f"| {GROUP} | plain | 1.00 | 1.00x | 1.00x |" in report


def test_a_turn_writes_the_schemas_json(model_dir: Path) -> None:
    """A random model writes the JSON its schema forces: `{"FIRST_KEY": ` opens every answer."""
    llm = quickdraft.load(model_dir, prefix_cache_mb=0)
    for q in load_questions(OWN_FILES[GROUP])[:3]:
        for method in ("none", "ngram"):
            run = lambda prompt, params, schema, method=method: _quickdraft_turn(llm, SpecConfig(method=method), prompt, params,
                                                                  schema)
            (record,) = run_conversation(llm, q.turns, SamplingParams(max_new_tokens=16), run, schema=q.schema)
            assert record["text"].startswith('{"' + next(iter(q.schema["properties"])) + '": '), record["text"]
            assert record["grammar_s"] > 0


def test_other_engines_rows_are_refused_under_a_schema(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "specbench", "--groups", GROUP, "--compare-hf"]) == 1  # before any model load
    assert "json_extraction answers under a JSON schema, which the transformers rows cannot apply" in \
        capsys.readouterr().err
