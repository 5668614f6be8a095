"""`quickdraft bench serve --replicas N,M`: the waves against `quickdraft serve --replicas N` started
per count, each replica's load from /metrics, and each count's tokens/s and texts against the
first's. The comparison over hand-made results; a real run against one process on a tiny model
(no Ray); and, slow, 1 process against 2 Ray replicas of SmolLM2 x 1 thread.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from quickdraft.bench.serve import RequestRecord, against, replicas_report, serve_command, summarize_level
from quickdraft.cli import main
from quickdraft.cluster.load import ONE_PROCESS
from support.bench import write_questions


def _run(texts: dict[int, str], walls: list[float], tokens: int = 10) -> dict:
    """One replica count's results at level 4, plain only, as run_serve_bench builds them: a wave per
    wall time."""
    waves = [(w, [RequestRecord(q, 1.0, 0.1, tokens, 1.0, t) for q, t in texts.items()]) for w in walls]
    return {"levels": {"4": summarize_level({"plain": waves})},
            "raw": {"4": {"plain": [{"wall_s": w, "requests": [asdict(r) for r in rs]} for w, rs in waves]}},
            "load": {"r1": {"routed": 2, "requests": 2, "prefilled_tokens": 30, "cached_tokens": 0,
                            "generated_tokens": 20, "cached_fraction": 0.0}}}


def test_each_count_is_compared_with_the_first_in_speed_and_text() -> None:
    one = _run({1: "a", 2: "b"}, [4.0])
    two = _run({1: "a", 2: "B"}, [2.0])
    r = against(two, one)["4"]["plain"]
    assert r["tokens_per_s_ratio"] == pytest.approx(2.0) and r["identical"] == 0.5  # question 2 differs
    assert against(one, one)["4"]["plain"] == {"tokens_per_s_ratio": 1.0, "identical": 1.0}
    flaky = _run({1: "a"}, [2.0, 2.0])
    flaky["raw"]["4"]["plain"][1]["requests"][0]["text"] = "other"  # two texts for one question: not the same
    assert against(flaky, _run({1: "a"}, [2.0]))["4"]["plain"]["identical"] == 0.0
    results = {"replicas": {"1": one, "2": two}, "base": "1",
               "against_base": {"1": against(one, one), "2": against(two, one)}}
    text = replicas_report(results)
    assert "### 1 replica (one process)" in text and "### 2 replicas" in text
    assert "| 2 | 4 | plain | 2.00x | 50% |" in text and "| r1 | 2 | 2 | 30 | 0 | 0.0% | 20 |" in text


def test_the_server_command_for_a_count() -> None:
    one, two = serve_command(["--model", "m"], 1, "prefix", 9000), serve_command(["--model", "m"], 2, "round-robin", 9)
    assert one[:4] == [sys.executable, "-m", "quickdraft", "serve"] and "--replicas" not in one
    assert two[two.index("--replicas") + 1] == "2" and two[two.index("--router") + 1] == "round-robin"
    assert two[two.index("--port") + 1] == "9" and two[two.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "distinct counts >= 1"), (["--replicas", "1,1"], "distinct counts >= 1"),
    (["--replicas", "two"], "comma-separated integers"), (["--spec", "none"], "or --replicas"),
    (["--replicas", "1", "--router", "nearest"], "invalid choice")])
def test_bad_replica_flags_are_one_line(flags: list[str], message: str, tmp_path, capsys) -> None:
    questions = write_questions(tmp_path / "q.jsonl")
    try:
        rc = main(["bench", "serve", "--model", "m", "--questions", str(questions), *flags])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc != 0 and message in capsys.readouterr().err


def test_bench_serve_on_one_process_reports_its_load(model_dir, tmp_path, capsys) -> None:
    """--replicas 1: `quickdraft serve` in a process of its own (no Ray); the load after the warm-up is
    exactly the waves' requests and tokens."""
    questions = write_questions(tmp_path / "q.jsonl")
    rc = main(["bench", "serve", "--model", str(model_dir), "--questions", str(questions), "--replicas", "1",
               "--spec", "none", "--concurrency", "2", "--requests", "3", "--rounds", "2", "-n", "8",
               "--threads", "1", "--json", "--no-progress", "--out", str(tmp_path / "out")])
    results = json.loads(capsys.readouterr().out)
    assert rc == 0 and list(results["replicas"]) == ["1"] and results["base"] == "1"
    run = results["replicas"]["1"]
    assert set(run["levels"]["2"]) == {"plain"}  # --spec none: plain waves only
    waves = run["raw"]["2"]["plain"]
    assert len(waves) == 2 and all(len(w["requests"]) == 3 for w in waves)
    load = run["load"][ONE_PROCESS]
    assert load["requests"] == 6 and load["routed"] == 0
    assert load["generated_tokens"] == sum(r["tokens"] for w in waves for r in w["requests"]) > 0
    assert load["cached_tokens"] == 0  # served with --no-prefix-cache: every round prefills again
    assert run["server"]["status"] == "ok" and (tmp_path / "out" / "logs" / "serve-1.log").exists()
    assert "Per replica" in (tmp_path / "out" / "serve.md").read_text()


@pytest.mark.slow
def test_one_process_against_two_ray_replicas(tmp_path, capsys) -> None:
    """1 process x 1 thread, then 2 replicas x 1 thread on a local Ray cluster, SmolLM2 greedy: the same
    texts, both replicas loaded, the front's routed count matching what each replica finished."""
    questions = write_questions(tmp_path / "q.jsonl")
    rc = main(["bench", "serve", "--model", "smollm2-135m", "--questions", str(questions), "--replicas", "1,2",
               "--spec", "none", "--concurrency", "4", "--requests", "4", "--rounds", "1", "-n", "16",
               "--threads", "1", "--json", "--no-progress"])
    results = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert results["against_base"]["2"]["4"]["plain"]["identical"] == 1.0
    assert results["against_base"]["2"]["4"]["plain"]["tokens_per_s_ratio"] > 0
    load = results["replicas"]["2"]["load"]
    assert len(load) == 2 and all(r["requests"] >= 1 for r in load.values()), load  # both replicas answered
    assert all(r["routed"] == r["requests"] for r in load.values()), load
    tokens = sum(r["tokens"] for w in results["replicas"]["2"]["raw"]["4"]["plain"] for r in w["requests"])
    assert sum(r["generated_tokens"] for r in load.values()) == tokens
