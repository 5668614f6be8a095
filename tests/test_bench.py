"""`quickdraft bench specbench` and `bench forward-cost` on a tiny random model with a handful of
questions written in the test (never a download).

Oracles: the metric definitions recomputed from the per-question records (plain's speedup and
tokens per pass are 1.00 by definition), the results.json schema table in docs/benchmarks.md
(both ways: every documented key exists, every key written is documented), and an engine broken
on purpose (its verifier accepts every draft) that the identity check must catch.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.bench import questions as qmod
from quickdraft.bench.questions import (
    OWN_QUESTIONS,
    SPEC_BENCH_GROUPS,
    Question,
    bench_questions,
    load_questions,
    parse_groups,
    resolve_questions_path,
    select_questions,
)
from quickdraft.bench.report import summarize
from quickdraft.bench.specbench import parse_methods, run_questions
from quickdraft.cli import main
from quickdraft.engine import scores
from quickdraft.engine.cost import measure_forward_cost
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import EACH, Committed, Draft
from quickdraft.proposers.registry import PROPOSERS, Registration
from quickdraft.spec.verify import Verdict
from support.bench import QUESTIONS, write_questions
from tiny_tokenizer import tiny_llm_dir

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def specbench(model_dir: Path, tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    rc = main(["bench", "specbench", "--model", str(model_dir), "--questions",
               str(write_questions(tmp_path / "q.jsonl")), "--max-new-tokens", "8", "--out", str(out),
               "--no-progress", "-k", "4", *extra])
    return rc, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


class Repeat7:
    """Proposes token 7 k times; harmless with a correct verifier, wrong output with a broken one."""
    group = EACH

    def __init__(self, ctx) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return Draft([7] * k, None)

    def commit(self, step: Committed) -> None:
        pass


class Unlikely7(Repeat7):
    """Proposes token 7 k times and says each is almost never accepted: the policy verifies none."""

    def propose(self, k: int) -> Draft:
        return Draft([7] * k, None, [0.01] * k)


def test_verify_all_adds_each_method_with_the_draft_length_policy_off(model_dir: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    monkeypatch.setitem(PROPOSERS, "unlikely7", Registration("unlikely7", Unlikely7))
    rc, res, _ = specbench(model_dir, tmp_path, "--methods", "plain,unlikely7", "--verify-all")
    assert rc == 0 and [m["label"] for m in res["methods"]] == ["plain", "unlikely7 k=4", "unlikely7 k=4 all"]
    assert [m["spec"]["adaptive"] for m in res["methods"][1:]] == [True, False]
    assert "--verify-all" in res["config"]["command"]
    adaptive, every = (res["summary"]["overall"][label] for label in ("unlikely7 k=4", "unlikely7 k=4 all"))
    assert adaptive["drafted_tokens"] == 0  # the policy believes the drafts' estimates: none verified
    assert every["identical_pct"] == 100.0
    # with the policy off every pass after a turn's prefill verifies the whole offered draft (4
    # tokens, fewer only where max_new_tokens leaves less room)
    decode_passes = every["target_passes"] - sum(q["turns"] for q in res["questions"])
    assert decode_passes > 0 and every["drafted_tokens"] >= decode_passes


# -- the report ----------------------------------------------------------------------------------------

def test_specbench_report_figures_follow_the_definitions(model_dir: Path, tmp_path: Path, capsys,
                                                        monkeypatch) -> None:
    monkeypatch.setitem(PROPOSERS, "repeat7", Registration("repeat7", Repeat7))
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain,ngram,repeat7:2")
    stdout = capsys.readouterr().out
    assert rc == 0 and res["failures"] == []
    labels = [m["label"] for m in res["methods"]]
    assert labels == ["plain", "ngram k=4", "repeat7 k=2"]
    assert list(res["summary"]["groups"]) == ["mt_bench", "qa"]  # writing + roleplay -> mt_bench
    assert sorted(q["question_id"] for q in res["questions"]) == [7, 9, 12, 81]
    for scope in [*res["summary"]["groups"].values(), res["summary"]["overall"]]:
        assert scope["plain"]["speedup"] == 1.0 and scope["plain"]["tokens_per_pass"] == 1.0
        for label in labels:
            assert scope[label]["identical_pct"] == 100.0
    for group, scope in [*res["summary"]["groups"].items(), ("overall", res["summary"]["overall"])]:
        qs = [q for q in res["questions"] if group in ("overall", q["group"])]
        plain_tps = statistics.fmean(q["runs"]["plain"]["tokens_per_s"] for q in qs)
        for label in labels:
            runs = [q["runs"][label] for q in qs]
            s = scope[label]
            assert s["questions"] == len(qs)
            assert s["tokens_per_s"] == pytest.approx(statistics.fmean(r["new_tokens"] / r["wall_s"] for r in runs))
            assert s["speedup"] == pytest.approx(s["tokens_per_s"] / plain_tps)
            passes = sum(r["target_passes"] for r in runs)
            assert s["tokens_per_pass"] == pytest.approx(sum(r["committed_tokens"] for r in runs) / passes)
    drafts = res["summary"]["overall"]["repeat7 k=2"]
    assert drafts["drafted_tokens"] > 0  # it drafts at every step
    assert drafts["acceptance_rate"] == pytest.approx(drafts["accepted_tokens"] / drafts["drafted_tokens"])
    # Two-turn question: both turns run, the second prompt holds the first turn and its answer.
    two = next(q for q in res["questions"] if q["question_id"] == 81)["runs"]["plain"]
    assert two["turns"] and len(two["turns"]) == 2
    t1, t2 = two["turns"]
    assert t2["prompt_tokens"] > t1["prompt_tokens"] + t1["new_tokens"]
    assert two["new_tokens"] == t1["new_tokens"] + t2["new_tokens"] > 0
    assert two["wall_s"] == pytest.approx(t1["wall_s"] + t2["wall_s"])
    # The tables, on stdout and in report.md.
    assert stdout == report
    for heading in ("### Overall", "### Speedup by task group", "### By task group"):
        assert heading in report
    assert re.search(r"^\| plain \| [\d.]+ \| 1\.00x \| 1\.00 \| – \| 100% \|$", report, re.M)
    assert re.search(r"^\| method \| mt_bench \| qa \| overall \|$", report, re.M)
    png = (tmp_path / "out" / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def documented_keys() -> list[str]:
    text = DOCS.read_text()
    section = text.split("## results.json schema", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def flatten(value, prefix: str = "", methods=(), groups=()) -> set[str]:
    """Key paths as the schema table writes them: lists as [], method and group keys as <...>."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return set().union(*(flatten(v, prefix + "[]", methods, groups) for v in value))
    if not isinstance(value, dict) or prefix == "methods[].spec":  # SpecConfig's fields: documented as one
        return {prefix}
    paths = set()
    for key, v in value.items():
        name = "<method>" if key in methods else "<group>" if key in groups and prefix.endswith("groups") else key
        paths |= flatten(v, f"{prefix}.{name}" if prefix else name, methods, groups)
    return paths


def test_results_json_matches_the_documented_schema(model_dir: Path, tmp_path: Path) -> None:
    rc, res, _ = specbench(model_dir, tmp_path, "--methods", "plain,ngram")
    assert rc == 0
    documented = set(documented_keys())
    assert "summary.overall.<method>.speedup" not in documented  # documented as one object row
    written = flatten(res, methods={m["label"] for m in res["methods"]}, groups=set(res["summary"]["groups"]))
    overall = {p for p in written if p.startswith("summary.overall.<method>.")}
    assert overall and {p.replace("summary.overall", "summary.groups.<group>") for p in overall} <= documented
    written = (written - overall) | {"summary.overall.<method>"}
    assert written == documented, (sorted(written - documented), sorted(documented - written))


def test_turns_ending_on_eos_count_the_stop_token_as_committed(model_dir: Path) -> None:
    """Plain commits one token per pass, the stop token included, so its tokens/pass is exactly 1
    even when turns end on EOS (where new tokens < passes)."""
    llm = quickdraft.load(model_dir)
    qs = [Question(q["question_id"], q["category"], qmod.GROUP_OF[q["category"]], tuple(q["turns"]))
          for q in QUESTIONS]
    plain = llm.generate(messages=[{"role": "user", "content": qs[1].turns[0]}],
                         params=SamplingParams(max_new_tokens=8)).token_ids
    llm.tokenizer.eos_token_ids = frozenset({plain[3]})  # an EOS the tiny model does produce
    methods = parse_methods("ngram:2", k=4, compare_hf=True)
    records = run_questions(llm, qs, methods, max_new_tokens=8, progress=False)
    summary = summarize(records, [m.label for m in methods])
    stopped = [q["runs"]["plain"] for q in records if q["runs"]["plain"]["turns"][-1]["finish_reason"] == "stop"]
    assert stopped and all(r["new_tokens"] < r["target_passes"] == r["committed_tokens"] for r in stopped)
    assert summary["overall"]["plain"]["tokens_per_pass"] == 1.0
    assert summary["overall"]["plain"]["new_tokens"] < summary["overall"]["plain"]["target_passes"]
    for label in ("ngram k=2", "hf-plain", "hf-prompt-lookup"):  # all stop where plain stops
        assert summary["overall"][label]["identical_pct"] == 100.0
        assert summary["overall"][label]["committed_tokens"] == summary["overall"]["plain"]["committed_tokens"]


def test_each_method_keeps_its_own_shared_state(model_dir: Path) -> None:
    """Suffix decoding learns from earlier responses: were its two rows ("suffix", "suffix all")
    one corpus, the second would find the first's answer to the same question whole. Each method
    has a scope of its own, the warm-up one that is not kept."""
    llm = quickdraft.load(model_dir)
    qs = [Question(q["question_id"], q["category"], qmod.GROUP_OF[q["category"]], tuple(q["turns"]))
          for q in QUESTIONS]
    made = []
    shared = llm.shared
    llm.shared = lambda key, make: made.append((llm._scope, key)) or shared(key, make)
    methods = parse_methods("suffix:4", k=4, verify_all=True)
    run_questions(llm, qs, methods, max_new_tokens=8, progress=False)
    scopes = {scope for scope, key in made if key[0] == "per scope" and key[1][0] == "suffix"}
    assert scopes == {"suffix k=4", "suffix k=4 all", ("warm-up", "suffix k=4"), ("warm-up", "suffix k=4 all")}
    assert llm._scope is None  # the default scope again, for whatever runs next


def test_traffic_runs_through_each_speculative_method_before_it_is_measured(model_dir: Path) -> None:
    """--traffic: each speculative method answers the traffic in its own scope before the questions
    (and before the warm-up, whose scope is its own); plain answers none of it; no record is made of it."""
    llm = quickdraft.load(model_dir)
    qs = [Question(q["question_id"], q["category"], qmod.GROUP_OF[q["category"]], tuple(q["turns"]))
          for q in QUESTIONS]
    made = []
    shared = llm.shared
    llm.shared = lambda key, make: made.append(llm._scope) or shared(key, make)
    methods = parse_methods("suffix:4", k=4)
    traffic = ["Tell me about the cat.", "Write the story again."]
    records = run_questions(llm, qs, methods, max_new_tokens=8, progress=False, traffic=traffic)
    turns = sum(len(q.turns) for q in qs)
    assert made == ["suffix k=4"] * len(traffic) + [("warm-up", "suffix k=4")] + ["suffix k=4"] * turns
    assert len(records) == len(qs) and all(set(r["runs"]) == {"plain", "suffix k=4"} for r in records)
    # the corpus holds the traffic's responses and the questions'
    corpus = next(state for key, state in llm._shared["suffix k=4"].items() if key[1][0] == "suffix").get("")
    assert len(corpus.docs) == len(traffic) + turns


def test_traffic_comes_from_sharegpt_without_the_benchmark_questions(model_dir: Path, tmp_path: Path,
                                                                     monkeypatch, capsys) -> None:
    from quickdraft.train import data
    conversations = [[{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
                     for text in ("Who wrote  hello hello?", "x" * 2001, "First.", "Second.", "Third.")]
    monkeypatch.setattr(data, "iter_sharegpt", lambda path: iter(conversations))
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain,ngram", "--traffic", "2")
    assert rc == 0 and res["config"]["traffic"] == 2 and "--traffic 2" in res["config"]["command"]
    banned = {t for q in QUESTIONS for t in q["turns"]}
    assert data.first_user_turns(data.without_benchmark(iter(conversations), banned), 2) == ["First.", "Second."]
    assert main(["bench", "specbench", "--model", str(model_dir), "--traffic", "-1", "--no-progress"]) == 1
    assert "--traffic must be >= 0, found -1" in capsys.readouterr().err
    assert main(["bench", "specbench", "--model", str(model_dir), "--questions", str(tmp_path / "q.jsonl"),
                 "--traffic", "4", "--no-progress"]) == 1
    assert "--traffic 4: the ShareGPT data has only 3 conversations" in capsys.readouterr().err


def test_shared_scopes_keep_state_apart(model_dir: Path) -> None:
    llm = quickdraft.load(model_dir)
    outer = llm.shared("key", object)
    with llm.shared_scope("a"):
        inner = llm.shared("key", object)
        assert llm.shared("key", object) is inner is not outer
    assert llm.shared("key", object) is outer


# -- the identity check --------------------------------------------------------------------------------

def accept_everything(drafts, target_logits, params, generators, masks=None, generated=None) -> Verdict:
    """A broken verifier: every draft token of a chain accepted, then the target's argmax after them."""
    return Verdict([list(range(len(d.tokens))) for d in drafts],
                   [d.tokens + [int(target_logits[b, len(d.tokens)].argmax())] for b, d in enumerate(drafts)])


def test_identity_check_catches_a_broken_engine(model_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(PROPOSERS, "repeat7", Registration("repeat7", Repeat7))
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain,repeat7,ngram")
    assert rc == 0 and res["failures"] == []  # the real verifier makes even this proposer exact
    assert res["summary"]["overall"]["repeat7 k=4"]["identical_pct"] == 100.0

    monkeypatch.setattr(scores, "verify", accept_everything)  # raising=True: fails loudly if renamed
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain,repeat7")
    assert rc == 1
    broken = res["summary"]["overall"]["repeat7 k=4"]
    assert broken["identical"] == 0 and broken["identical_pct"] == 0.0
    assert sorted(broken["different_question_ids"]) == [7, 9, 12, 81]
    assert all(q["runs"]["repeat7 k=4"]["first_difference"] is not None for q in res["questions"])
    assert len(res["failures"]) == 1 and res["failures"][0].startswith("FAILURE: repeat7 k=4: 4 of 4")
    assert res["failures"][0] in capsys.readouterr().out and res["failures"][0] in report


def test_sampling_reports_no_identity_and_fails_nothing(model_dir: Path, tmp_path: Path) -> None:
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain,ngram", "--temperature", "0.8",
                                "--seed", "3")
    assert rc == 0 and res["failures"] == []
    assert res["summary"]["overall"]["ngram k=4"]["identical_pct"] is None
    assert res["summary"]["overall"]["plain"]["speedup"] == 1.0


def test_compare_hf_rows_report_identity_but_are_exempt(model_dir: Path, tmp_path: Path) -> None:
    rc, res, report = specbench(model_dir, tmp_path, "--methods", "plain", "--compare-hf", "--groups", "qa")
    assert rc == 0 and [m["label"] for m in res["methods"]] == ["plain", "hf-plain", "hf-prompt-lookup"]
    for label in ("hf-plain", "hf-prompt-lookup"):
        s = res["summary"]["overall"][label]
        assert s["questions"] == 2 and s["identical_pct"] is not None and s["target_passes"] is None
        assert s["speedup"] > 0
    assert "| hf-prompt-lookup |" in report
    with pytest.raises(QuickdraftError, match="greedily"):
        main_raises(["bench", "specbench", "--model", str(model_dir), "--questions", str(tmp_path / "q.jsonl"),
                     "--compare-hf", "--temperature", "0.5", "--no-progress"])


def main_raises(argv: list[str]) -> None:
    from quickdraft.cli import build_parser
    args = build_parser().parse_args(argv)
    args.func(args)


# -- methods and questions -----------------------------------------------------------------------------

def test_parse_methods() -> None:
    methods = parse_methods("ngram:8,draft:/models/small:2,ngram", k=3)
    assert [m.label for m in methods] == ["plain", "ngram k=8", "draft:small k=2", "ngram k=3"]
    assert methods[2].spec.draft_model == "/models/small" and methods[2].spec.k == 2
    assert parse_methods("draft:/models/small", k=5)[1].spec.k == 5
    heads = parse_methods("head,head:8,hybrid:/heads/h1:2,hybrid:/heads/h2", k=5)[1:]
    assert [(m.spec.method, m.spec.head, m.spec.k) for m in heads] == [
        ("head", None, 5), ("head", None, 8), ("hybrid", "/heads/h1", 2), ("hybrid", "/heads/h2", 5)]
    assert [m.label for m in parse_methods("plain", 4, compare_hf=True)] == ["plain", "hf-plain", "hf-prompt-lookup"]
    for bad, message in [("medusa", "unknown method 'medusa'.*ngram"), ("ngram,ngram:4", "twice"),
                         ("ngram:x", "integer K"), ("draft", "needs a model"), ("ngram:99", "k must be")]:
        with pytest.raises(QuickdraftError, match=message):
            parse_methods(bad, k=4)


def test_questions_default_path_groups_and_limit(tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    monkeypatch.chdir(repo)
    monkeypatch.setattr(qmod, "REPO_ROOT", tmp_path / "elsewhere")
    with pytest.raises(QuickdraftError, match="--questions PATH"):
        resolve_questions_path(None)
    shared = tmp_path / "shared" / "data" / "specbench"
    shared.mkdir(parents=True)
    rows = [{"question_id": i, "category": c, "turns": ["x"]}
            for i, c in enumerate(["writing"] * 3 + ["coding"] * 2 + ["rag"] * 2)]
    write_questions(shared / "questions.jsonl", rows)
    assert resolve_questions_path(None) == (shared / "questions.jsonl").resolve()
    qs = load_questions(resolve_questions_path(None))
    picked = select_questions(qs, ["mt_bench", "rag"], limit=3)
    assert [(q.question_id, q.category) for q in picked] == [(0, "writing"), (3, "coding"), (1, "writing"),
                                                              (5, "rag"), (6, "rag")]
    write_questions(tmp_path / "bad.jsonl", [{"question_id": 1, "category": "poetry", "turns": ["x"]}])
    with pytest.raises(QuickdraftError, match="'poetry' belongs to no benchmark group"):
        load_questions(tmp_path / "bad.jsonl")
    assert main(["bench", "specbench", "--groups", "qa,poems"]) == 1  # fails before any model load


def test_code_edit_group_ships_and_needs_no_spec_bench_file(tmp_path: Path, monkeypatch) -> None:
    qs = load_questions(OWN_QUESTIONS)
    assert len(qs) == 10 and {q.group for q in qs} == {"code_edit"}
    assert all(len(q.turns) == 1 and q.turns[0].count("```") == 2 for q in qs)  # an instruction and its code
    assert parse_groups(None) == list(SPEC_BENCH_GROUPS)  # Spec-Bench's six unless code_edit is named
    assert parse_groups("rag,code_edit") == ["rag", "code_edit"]
    # No Spec-Bench file anywhere: code_edit alone still runs, a Spec-Bench group says what is missing.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(qmod, "REPO_ROOT", tmp_path / "elsewhere")
    assert bench_questions(["code_edit"], None) == (qs, [OWN_QUESTIONS])
    with pytest.raises(QuickdraftError, match="--questions PATH"):
        bench_questions(["rag", "code_edit"], None)
    out, model = tmp_path / "out", tiny_llm_dir(tmp_path / "model", max_position_embeddings=1024)
    assert main(["bench", "specbench", "--model", str(model), "--groups", "code_edit", "--limit", "2",
                 "--max-new-tokens", "4", "--methods", "plain,ngram", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["summary"]["groups"]) == ["code_edit"]
    assert [q["question_id"] for q in res["questions"]] == ["code_edit_1", "code_edit_2"]
    assert res["config"]["questions"] == str(OWN_QUESTIONS)


# -- forward cost --------------------------------------------------------------------------------------

def test_measure_forward_cost_on_a_tiny_model(model_dir: Path) -> None:
    model = quickdraft.load(model_dir).model
    cost = measure_forward_cost(model, [2, 4, 8], context_len=32, repeats=3)
    assert sorted(cost.ratios) == [1, 2, 4, 8] and cost.ratios[1] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in cost.ratios.values())
    assert cost.t1_s == cost.median_s[1] > 0
    assert cost.ratios[8] == pytest.approx(cost.median_s[8] / cost.t1_s)
    assert sorted(cost.head_s) == [1, 2, 4, 8] and all(0 < cost.head_s[q] < cost.median_s[q] for q in cost.head_s)
    with pytest.raises(ValueError, match="exceed the model's 256 positions"):
        measure_forward_cost(model, [64], context_len=200)


def test_forward_cost_command_writes_json_and_png(model_dir: Path, tmp_path: Path, capsys) -> None:
    rc = main(["bench", "forward-cost", "--model", str(model_dir), "--max-q", "6", "--context", "16",
               "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    record = json.loads((tmp_path / "forward_cost.json").read_text())
    assert list(record["ratios"]) == ["1", "2", "3", "4", "5", "6"] and record["ratios"]["1"] == 1.0
    assert (tmp_path / "forward_cost.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert re.search(r"^\| 1 \| [\d.]+ \| 1\.00 \| 1\.000 \| [\d.]+ \| 0\.\d+ \| \d+% \|$", out, re.M) and "| 6 |" in out
    assert list(record["head_s"]) == list(record["ratios"]) and record["head_s"]["6"] < record["median_s"]["6"]
    assert main(["bench", "forward-cost", "--model", str(model_dir), "--context", "250", "--max-q", "16"]) == 1
    assert main(["bench", "forward-cost", "--model", str(model_dir), "--threads", "0"]) == 1


def test_bench_serve_runs_both_modes_at_each_level(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--model", str(model_dir), "--questions", str(write_questions(tmp_path / "q.jsonl")),
               "--concurrency", "1,3", "--requests", "4", "--rounds", "2", "-n", "12", "-k", "4",
               "--out", str(out), "--no-progress"])
    results = json.loads((out / "serve.json").read_text())
    assert rc == 0 and set(results["levels"]) == {"1", "3"}
    for c, level in results["levels"].items():
        assert level["identical"] == 1.0  # greedy text is the same with and without speculation
        for mode in ("plain", "speculative"):
            waves = results["raw"][c][mode]
            assert len(waves) == 2 and all(len(w["requests"]) == 4 for w in waves)
            tokens = sum(r["tokens"] for w in waves for r in w["requests"])
            assert level[mode]["tokens"] == tokens > 0
            expected = statistics.median(sum(r["tokens"] for r in w["requests"]) / w["wall_s"] for w in waves)
            assert level[mode]["tokens_per_s"] == pytest.approx(expected)
        assert level["plain"]["tokens_per_pass"] == 1.0
        assert level["throughput_ratio"] == pytest.approx(level["speculative"]["tokens_per_s"] / level["plain"]["tokens_per_s"])
    assert "| 3 | speculative |" in (out / "serve.md").read_text()


def test_built_in_prompts_are_raw_text_for_a_model_without_a_chat_template(tmp_path) -> None:
    """A base model (Gemma 3 270M's GGUF has no chat template) is benchmarked on the prompts' text,
    and the run says so; a chat model on a user turn of its template."""
    from quickdraft.bench.plain import PROMPTS, prompt_format, prompt_ids
    from quickdraft.weights.tokenizers import load_hf_tokenizer
    from tiny_tokenizer import save_tokenizer

    chat = load_hf_tokenizer(save_tokenizer(tmp_path / "chat"))
    base = load_hf_tokenizer(save_tokenizer(tmp_path / "base", chat_template=None))
    text = PROMPTS[0]
    assert prompt_ids(chat, text) == chat.apply_chat_template([{"role": "user", "content": text}]) != chat.encode(text)
    assert prompt_ids(base, text) == base.encode(text)
    assert (prompt_format(chat), prompt_format(base)) == ("chat template", "raw text (the model has no chat template)")
