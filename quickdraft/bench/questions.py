"""Benchmark questions: finding the Spec-Bench file, reading it, mapping categories to its six task
groups (plus quickdraft's own input-grounded group, code_edit, shipped with the package) and picking
`--limit` questions per group.

Knows the question file's format (one JSON object a line: question_id, category, turns) and
nothing of models or decoding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Sequence

from quickdraft.errors import QuickdraftError

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
# quickdraft's own group, not Spec-Bench's: edits whose answer rewrites the code (or query) in the
# prompt, the input-grounded case prompt lookup is made for and Spec-Bench lacks. Ten tasks written
# once before they were first measured, never tuned on (bench/data/code_edit.jsonl).
OWN_GROUPS: dict[str, tuple[str, ...]] = {"code_edit": ("code_edit",)}
OWN_QUESTIONS = Path(__file__).resolve().parent / "data" / "code_edit.jsonl"
GROUPS = {**SPEC_BENCH_GROUPS, **OWN_GROUPS}
GROUP_OF = {category: group for group, categories in GROUPS.items() for category in categories}


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    group: str
    turns: tuple[str, ...]  # user messages; MT-bench questions have two


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
            questions.append(Question(qid, category, GROUP_OF[category], tuple(turns)))
    if not questions:
        raise QuickdraftError(f"{path} holds no questions")
    return questions


def bench_questions(groups: Sequence[str], path: str | Path | None) -> tuple[list[Question], list[Path]]:
    """The questions `groups` draw from and the files read: the Spec-Bench file (`path`, or the
    default one) for its groups, the packaged file for quickdraft's own."""
    files = [resolve_questions_path(path)] if any(g in SPEC_BENCH_GROUPS for g in groups) else []
    files += [OWN_QUESTIONS] if any(g in OWN_GROUPS for g in groups) else []
    return [q for f in files for q in load_questions(f)], files


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
