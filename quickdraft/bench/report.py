"""Spec-Bench summaries: per-question records -> per-group and overall figures, markdown tables,
identity failures, results.json, report.md and speedup.png.

Definitions (Spec-Bench's, see docs/benchmarks.md): speedup = mean over questions of tokens/s
with the method / the same mean for plain decoding; decode speedup = the same over each turn's
tokens after its first, timed from the first (the prefill, the same for every method, left out:
what speculation changes; quickdraft's rows only); tokens per pass = tokens committed (a
stop token included) / target forward passes, pooled over the questions (1.00 for plain). Under a
JSON schema, the grammar's share = its own time (masks, draft shaping, advancing) / the run's
wall time, pooled.
Knows records and files only, nothing of models or decoding.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from quickdraft.bench.questions import GROUPS
from quickdraft.bench.specbench import PLAIN

SCHEMA = "quickdraft.specbench/1"


def _sum(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else sum(values)


def summarize_runs(questions: Sequence[dict], label: str) -> dict[str, Any]:
    """One method's figures over `questions` (records from specbench.run_questions)."""
    runs = [q["runs"][label] for q in questions]
    plain_tps = statistics.fmean(q["runs"][PLAIN]["tokens_per_s"] for q in questions)
    tps = statistics.fmean(r["tokens_per_s"] for r in runs)
    decode = [r.get("decode_tokens_per_s") for r in runs] + [q["runs"][PLAIN].get("decode_tokens_per_s") for q in questions]
    decode_speedup = None if None in decode else (statistics.fmean(decode[:len(runs)]) /
                                                  statistics.fmean(decode[len(runs):]))
    passes, drafted, accepted, grammar_s = (_sum([r.get(key) for r in runs]) for key in
                                            ("target_passes", "drafted_tokens", "accepted_tokens", "grammar_s"))
    wall = sum(r["wall_s"] for r in runs)
    committed = sum(r["committed_tokens"] for r in runs)
    flags = [r["identical_to_plain"] for r in runs]
    identical = None if any(f is None for f in flags) else sum(flags)
    return {
        "questions": len(runs), "new_tokens": sum(r["new_tokens"] for r in runs),
        "committed_tokens": committed, "wall_s": wall,
        "tokens_per_s": tps, "speedup": tps / plain_tps if plain_tps > 0 else None, "decode_speedup": decode_speedup,
        "target_passes": passes, "tokens_per_pass": committed / passes if passes else None,
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "grammar_s": grammar_s, "grammar_share": grammar_s / wall if grammar_s is not None and wall > 0 else None,
        "grammar_ms_per_pass": 1e3 * grammar_s / passes if grammar_s is not None and passes else None,
        "identical": identical, "identical_pct": None if identical is None else 100.0 * identical / len(runs),
        "different_question_ids": [q["question_id"] for q, f in zip(questions, flags) if f is False],
    }


def summarize(questions: Sequence[dict], labels: Sequence[str]) -> dict[str, Any]:
    groups = [g for g in GROUPS if any(q["group"] == g for q in questions)]
    return {
        "groups": {g: {label: summarize_runs([q for q in questions if q["group"] == g], label)
                       for label in labels} for g in groups},
        "overall": {label: summarize_runs(questions, label) for label in labels},
    }


def identity_failures(summary: dict[str, Any], methods: Sequence[dict]) -> list[str]:
    """A FAILURE line per greedy quickdraft method whose outputs are not all identical to plain's.
    The transformers and llama.cpp rows are exempt (other implementations' numerics), but still
    reported."""
    lines = []
    for m in methods:
        s = summary["overall"][m["label"]]
        if m["engine"] != "quickdraft" or s["identical_pct"] is None or s["identical"] == s["questions"]:
            continue
        ids = ", ".join(str(i) for i in s["different_question_ids"][:20])
        lines.append(f"FAILURE: {m['label']}: {s['questions'] - s['identical']} of {s['questions']} greedy "
                     f"outputs differ from plain decoding (question ids {ids}); speculative decoding "
                     f"must be exact")
    return lines


def build_results(config: dict[str, Any], methods: Sequence[dict], questions: Sequence[dict]) -> dict[str, Any]:
    summary = summarize(questions, [m["label"] for m in methods])
    return {"schema": SCHEMA, "config": config, "methods": list(methods), "summary": summary,
            "failures": identity_failures(summary, methods), "questions": list(questions)}


def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _method_cells(s: dict[str, Any]) -> str:
    return (f"{_f(s['tokens_per_s'], '.1f')} | {_f(s['speedup'], '.2f', 'x')} | "
            f"{_f(s['tokens_per_pass'], '.2f')} | {_f(s['acceptance_rate'], '.0%')} | "
            f"{_f(s['identical_pct'], '.0f', '%')}")


def markdown_report(results: dict[str, Any]) -> str:
    c, summary = results["config"], results["summary"]
    labels = [m["label"] for m in results["methods"]]
    groups = list(summary["groups"])
    n = summary["overall"][PLAIN]["questions"]
    counts = ", ".join(f"{g} {summary['groups'][g][PLAIN]['questions']}" for g in groups)
    out = [f"## Spec-Bench: {c['model']} ({c['dtype']}, {c['device']}, {c['threads']} threads)", "",
           f"{n} questions ({counts}), "
           f"max {c['max_new_tokens']} new tokens per turn, temperature {c['temperature']}, batch 1. "
           f"Speedup = mean tokens/s over questions / the same for plain; tokens/pass = tokens committed "
           f"per target forward pass; identical = outputs token-for-token equal to plain decoding "
           f"(greedy only).", ""]
    if c.get("command"):
        out += [f"Command: `{c['command']}`", ""]
    head = "| tokens/s | speedup | tokens/pass | acceptance | identical |"
    out += ["### Overall", "", f"| method {head}", "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {label} | {_method_cells(summary['overall'][label])} |" for label in labels]
    out += ["", "### Speedup by task group", "", "| method | " + " | ".join(groups) + " | overall |",
            "|---|" + "---:|" * (len(groups) + 1)]
    for label in labels:
        cells = [_f(summary["groups"][g][label]["speedup"], ".2f", "x") for g in groups]
        out.append(f"| {label} | {' | '.join(cells)} | {_f(summary['overall'][label]['speedup'], '.2f', 'x')} |")
    out += ["", "### By task group", "", f"| group | method | questions {head}", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for g in groups:
        for label in labels:
            s = summary["groups"][g][label]
            out.append(f"| {g} | {label} | {s['questions']} | {_method_cells(s)} |")
    constrained = [g for g in groups if summary["groups"][g][PLAIN]["grammar_s"] is not None]
    if constrained:
        out += ["", "### Under a JSON schema", "", "Every row of these groups answers under the question's schema "
                "(response_format json_schema), plain decoding too; the grammar's share: its own time (masks, "
                "draft shaping, advancing) / wall time; decode speedup: the speedup of the tokens after each turn's "
                "first (a document's prefill, the same for every row, left out).", "",
                "| group | method | tokens/pass | speedup | decode speedup | grammar's share | grammar ms/pass |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for g in constrained:
            for label in labels:
                s = summary["groups"][g][label]
                out.append(f"| {g} | {label} | {_f(s['tokens_per_pass'], '.2f')} | {_f(s['speedup'], '.2f', 'x')} | "
                           f"{_f(s['decode_speedup'], '.2f', 'x')} | {_f(s['grammar_share'], '.1%')} | "
                           f"{_f(s['grammar_ms_per_pass'], '.2f')} |")
    engines = {m["engine"] for m in results["methods"]}
    if "transformers" in engines:
        out += ["", "transformers rows: tokens/pass and acceptance are not reported by its generate; their "
                    "identity with plain is reported but not required (different numerics)."]
    if "llama.cpp" in engines:
        out += ["", "llama.cpp rows: the same GGUF file, prompt ids and thread count; speedup is over quickdraft's "
                    "plain row; identity with plain is reported but not required (different numerics)."]
    if results["failures"]:
        out += [""] + results["failures"]
    return "\n".join(out) + "\n"


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    from quickdraft.bench.plot import plot_speedup
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(markdown_report(results))
    summary, c = results["summary"], results["config"]
    columns = [*summary["groups"], "overall"]
    speedups = {m["label"]: {col: (summary["groups"][col] if col != "overall" else summary["overall"])
                             [m["label"]]["speedup"] for col in columns}
                for m in results["methods"] if m["label"] != PLAIN}
    title = (f"Speedup over plain decoding: {c['model']} ({c['dtype']}, {c['device']}), "
             f"max {c['max_new_tokens']} new tokens, temperature {c['temperature']}")
    plot_speedup(speedups, columns, title, out / "speedup.png")
    return [out / "results.json", out / "report.md", out / "speedup.png"]
