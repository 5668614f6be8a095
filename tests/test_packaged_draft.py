"""A target knows its draft: `--spec draft` without `--draft-model` uses the packaged draft of a
packaged target (weights/packaged.py's PACKAGED_DRAFTS), from the Python API, `generate`, `serve`,
`bench specbench` and `bench serve`; a target without one is an error naming the option to pass.

A tiny packaged pair made in the test: two tiny random GGUF files (same tokenizer, different
weights) in a package on sys.path, registered under packaged names as the real ones are. Oracles:
the file each model was loaded from, plain decoding's tokens (speculation must equal them), and
the models the loader was asked for (the draft loads at start-up, before any request).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.api import LLM
from quickdraft.cli import main
from quickdraft.proposers import SpecConfig, SpecConfigError
from quickdraft.weights import packaged, resolve
from tiny_tokenizer import tiny_model, write_llama_gguf

PROMPT = "the cat sat on the mat and the cat sat on the"
PACKAGE = "qd_tiny_pair"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pair")
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    return {"root": root, "target": write_llama_gguf(tiny_model(seed=0), pkg / "target.gguf"),
            "draft": write_llama_gguf(tiny_model(seed=3), pkg / "draft.gguf")}


@pytest.fixture()
def pair(files: dict[str, Path], monkeypatch) -> dict[str, Path]:
    """`tiny-target` and `tiny-draft` as packaged names, the first drafting with the second."""
    monkeypatch.syspath_prepend(str(files["root"]))
    monkeypatch.setitem(resolve.PACKAGED_MODELS, "tiny-target", (PACKAGE, "target.gguf"))
    monkeypatch.setitem(resolve.PACKAGED_MODELS, "tiny-draft", (PACKAGE, "draft.gguf"))
    monkeypatch.setitem(packaged.PACKAGED_DRAFTS, "tiny-target", "tiny-draft")
    return files


def test_the_real_pair_is_registered() -> None:
    assert packaged.packaged_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert set(packaged.PACKAGED_DRAFTS.items()) <= {(t, d) for t in packaged.CHUNKED_MODELS
                                                     for d in packaged.CHUNKED_MODELS}
    assert packaged.packaged_draft("qwen2.5-coder-0.5b") is None and packaged.packaged_draft(None) is None


def test_api_drafts_with_the_packaged_draft(pair: dict[str, Path]) -> None:
    # every draft verified: this random draft's tokens are rarely right, so the policy would verify few
    llm = quickdraft.load("tiny-target", spec=SpecConfig("draft", k=3, adaptive=False))
    assert llm.loaded.source.name == "tiny-target" and llm.draft_name() == "tiny-draft"
    draft = llm.draft_model()
    assert draft is llm.draft_model("tiny-draft") and draft.loaded.source.path == pair["draft"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    out = llm.generate(PROMPT, params=params)  # the model's default speculation: the packaged draft
    assert out.stats.drafted_tokens > 0
    assert out.token_ids == llm.generate(PROMPT, params=params, spec=SpecConfig(method="none")).token_ids
    assert llm.draft_name("elsewhere.gguf") == "elsewhere.gguf"  # a named draft wins


def test_a_target_without_a_packaged_draft_says_what_to_pass(pair: dict[str, Path]) -> None:
    with pytest.raises(SpecConfigError, match=f"none ships for a model loaded from {pair['target']}.*--draft-model"):
        quickdraft.load(pair["target"], spec=SpecConfig("draft"))  # by path: not the packaged name
    with pytest.raises(SpecConfigError, match="none ships for the packaged model 'tiny-draft'.*"
                                              "qwen2.5-coder-1.5b -> qwen2.5-coder-0.5b"):
        quickdraft.load("tiny-draft", spec=SpecConfig("draft"))
    llm = quickdraft.load(pair["target"])
    with pytest.raises(SpecConfigError, match="SpecConfig\\(draft_model=...\\)"):
        llm.generate(PROMPT, spec=SpecConfig("draft"))
    assert SpecConfig("draft", k=0).enabled is False  # k = 0 asks for nothing: plain, no draft needed
    assert quickdraft.load(pair["target"], spec=SpecConfig("draft", k=0)).spec.draft_model is None


def test_generate_command(pair: dict[str, Path], monkeypatch, capsys) -> None:
    import quickdraft.api
    asked = []
    load_model = quickdraft.api.load_model
    monkeypatch.setattr(quickdraft.api, "load_model", lambda name, *a, **kw: asked.append(str(name)) or
                        load_model(name, *a, **kw))
    argv = ["generate", "--prompt", PROMPT, "-n", "16", "--ignore-eos", "--spec", "draft", "-k", "3"]
    assert main(argv + ["-m", "tiny-target", "--compare", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # the draft drafts for it (how much of its drafts the policy verifies is the policy's business:
    # this random one's confidence is low, its tokens rarely the target's)
    assert res["identical"] and asked == ["tiny-target", "tiny-draft"]
    assert main(argv + ["-m", str(pair["target"])]) == 1
    assert "--draft-model NAME|PATH" in capsys.readouterr().err


def test_serve_command_loads_the_draft_at_start_up(pair: dict[str, Path], monkeypatch, capsys) -> None:
    import quickdraft.api
    import quickdraft.server
    asked, served = [], {}
    load_model = quickdraft.api.load_model
    monkeypatch.setattr(quickdraft.api, "load_model", lambda name, *a, **kw: asked.append(str(name)) or
                        load_model(name, *a, **kw))
    monkeypatch.setattr(quickdraft.server, "serve", lambda llm, config, *rest: served.update(llm=llm, config=config))
    assert main(["serve", "-m", "tiny-target", "--spec", "draft", "--no-measure-cost"]) == 0
    assert asked == ["tiny-target", "tiny-draft"]  # before the server starts, not at the first request
    llm: LLM = served["llm"]
    assert served["config"].spec.method == "draft" and llm.draft_model().loaded.source.path == pair["draft"]
    assert main(["serve", "-m", str(pair["target"]), "--spec", "draft", "--no-measure-cost"]) == 1
    assert "--draft-model" in capsys.readouterr().err


def test_bench_specbench_method_draft(pair: dict[str, Path], tmp_path: Path, capsys) -> None:
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [PROMPT]}) + "\n")
    argv = ["bench", "specbench", "--questions", str(qfile), "--groups", "qa", "-n", "12", "--no-progress", "--json",
            "--methods", "plain,draft:3", "--verify-all"]
    assert main(argv + ["-m", "tiny-target"]) == 0
    res = json.loads(capsys.readouterr().out)
    # a random draft: the policy may rightly verify none of it (its call from the engine's measured
    # step times), so the premise that drafts were made and checked is the policy-off row's
    adaptive, every = (res["summary"]["overall"][f"draft:tiny-draft k=3{all_}"] for all_ in ("", " all"))
    assert adaptive["identical_pct"] == every["identical_pct"] == 100.0 and every["drafted_tokens"] > 0
    assert res["methods"][1]["spec"]["draft_model"] == "tiny-draft"
    assert main(argv + ["-m", str(pair["target"])]) == 1
    assert "draft:NAME|PATH[:K]" in capsys.readouterr().err


def test_bench_serve_spec_draft(pair: dict[str, Path], tmp_path: Path) -> None:
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"{PROMPT} {i}"]}) + "\n"
                             for i in range(2)))
    out = tmp_path / "serve"
    assert main(["bench", "serve", "-m", "tiny-target", "--spec", "draft", "-k", "3", "--questions", str(qfile),
                 "--groups", "qa", "--concurrency", "1", "--requests", "2", "--rounds", "1", "-n", "8",
                 "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "serve.json").read_text())
    assert res["config"]["draft_model"] == "tiny-draft" and res["levels"]["1"]["identical"] == 1.0
