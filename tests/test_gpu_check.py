"""scripts/gpu_check.py in its CPU mode (--tiny): the run a GPU machine makes, on tiny shapes here.

Oracles: the script's own checks (plain greedy decoding, transformers' logits, the plain sampling
law and its negative control) all pass on CPU, and its JSON carries every figure the docs quote
from a GPU run, with forced acceptance in effect (every pass commits k+1 tokens).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from quickdraft.proposers import PROPOSERS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_tiny_run_passes_and_records_every_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_check
    gpu_check.main([str(tmp_path), "--tiny"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    assert data["ok"] is True and data["skipped"] == 0 and data["device"] == "cpu"
    assert all("error" not in s for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    cases = sections["exactness"]["cases"]
    assert {c["method"] for c in cases} == set(PROPOSERS) and {c["batch"] for c in cases} == {1, 3}
    assert {c["model"] for c in cases} == {c["model"] for c in sections["parity"]["cases"]} == \
        {"llama-gqa-untied", "mixtral"}  # a mixture of experts among them
    assert all(c["ok"] and c["drafted"] > 0 for c in cases)
    assert all(c["ok"] for name in ("parity", "api", "sampling", "features", "training") for c in sections[name]["cases"])
    features = sections["features"]["cases"]
    assert {c["case"] for c in features} == {"prefix cache", "chat, prefix cache", "json schema",
                                             "penalties, bias, logprobs"}
    assert {c.get("spec") for c in features} == {None, "plain", "ngram", "draft"}
    assert {c["case"] for c in sections["training"]["cases"]} == {"fused layers, loss and acceptance",
                                                                  "killed at step 41, resumed"}
    speed = sections["speed"]
    assert {"quickdraft", "transformers", "decode_ratio"} <= set(speed["plain"])
    assert list(speed["forward_cost"]["ratios"]) == ["1", "2", "3", "4", "5"]
    for kind in ("free", "draft"):
        run = speed[f"spec_{kind}_k2"]
        assert run["forced"] and run["tokens_per_pass"] > 2.5  # 16 tokens: the prefill's, then 5 passes of 3
    assert "== speed" in (tmp_path / "gpu_check.log").read_text()


def test_the_exactness_check_fails_an_engine_that_accepts_wrong_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: under the speed check's forced acceptance every draft is taken, so
    prompt lookup's wrong guesses reach the output, and the exactness case must say where."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_check
    import gpu_speed

    from support.engine import JOBS
    from support.models import tiny
    name = "llama-gqa-untied"
    plain = {"alone": (1,), (name, 1): replace(JOBS[1], make=None, k=0).alone(tiny(name, init=0.1))}
    with gpu_speed.forced_acceptance():
        case = gpu_check.exact_case("ngram", name, 4, False, "cpu", plain)
    assert not case["ok"] and case["drafted"] > 0
    wrong = case["detail"][0]
    assert wrong["plain"] != wrong["spec"] and wrong["top2_gap"] > 1e-3  # a real disagreement, not a tie
