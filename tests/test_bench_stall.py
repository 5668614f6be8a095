"""`quickdraft bench stall` on a tiny model: the running stream keeps getting tokens while a long
prompt is prefilled (chunked prefill), and the report's figures follow from its measurements."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import quickdraft
from quickdraft.bench.stall import long_prompt, measure_round
from quickdraft.cli import main
from tiny_tokenizer import tiny_llm_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llm_dir(tmp_path_factory.mktemp("stall") / "model", max_position_embeddings=1024)


def test_the_stream_keeps_decoding_while_a_long_prompt_is_prefilled(model_dir: Path) -> None:
    llm = quickdraft.load(model_dir)
    r = measure_round(llm, long_prompt(llm, 16, salt=0), long_prompt(llm, 600, salt=1), usual_tokens=8)
    assert r.prompt_tokens == 600 and r.cached_tokens == 0
    assert len(r.gaps_s) >= 3, "the long prompt was prefilled in one step: the stream stopped for all of it"
    assert r.usual_gap_s > 0 and r.worst == max(r.gaps_s) / r.usual_gap_s
    engine = llm.engine_service().engine
    assert engine.num_running == engine.num_waiting == 0  # both requests are gone


def test_the_command_reports_each_round(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "stall", "--model", str(model_dir), "--prompt-tokens", "300", "--stream-tokens", "8",
                 "--rounds", "2", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 300 and len(out["rounds"]) == 2
    assert out["worst_ratio"] == max(r["worst_ratio"] for r in out["rounds"])
    assert main(["bench", "stall", "--model", str(model_dir), "--prompt-tokens", "2000"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_the_rounds_run_with_the_loaded_objects_frozen_as_a_server_s_loop(model_dir: Path, monkeypatch) -> None:
    """A full collection over the loaded model's objects paused streams 2-3 steps (engine/service.py,
    loaded_objects_frozen): the rounds run as the server's loop does, and the collector is whole after."""
    import gc

    from quickdraft.bench import stall
    seen = []
    monkeypatch.setattr(stall, "measure_round", lambda *a, **k: seen.append(gc.get_freeze_count()) or
                        stall.StallRound(0.01, [0.01], 300, 0, 0.1))
    assert gc.get_freeze_count() == 0
    assert main(["bench", "stall", "--model", str(model_dir), "--prompt-tokens", "300", "--rounds", "2"]) == 0
    assert len(seen) == 2 and min(seen) > 10_000  # the model, tokenizer and modules: frozen
    assert gc.get_freeze_count() == 0
