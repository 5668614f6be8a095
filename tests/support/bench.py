"""The benchmark tests' inputs: the tiny model's directory (`model_dir`, a fixture) and questions
written in the test (test_bench's)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_tokenizer import tiny_llm_dir

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write the theme of the story.", "Now the the again."]},
    {"question_id": 7, "category": "qa", "turns": ["the cat the cat the cat the"]},
    {"question_id": 9, "category": "qa", "turns": ["Who wrote hello hello?"]},
    {"question_id": 12, "category": "roleplay", "turns": ["Be a storm.", "Stop."]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llm_dir(tmp_path_factory.mktemp("bench") / "model")


def write_questions(path: Path, rows: list[dict] = QUESTIONS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
