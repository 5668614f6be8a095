"""`bench plain --compare-llamacpp` without llama.cpp: the schedule and the report (bench/compare.py)
with fake engines on a fake clock, and the command end to end on a tiny GGUF with a hand-written
greedy loop standing in for llama.cpp.

Oracles: costs the fake engines charge to the clock (so every median and ratio is known in
advance), the order of the calls the engines see, and a greedy loop over the model's forward.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch

from quickdraft.bench import vs_llamacpp
from quickdraft.bench.compare import CompareConfig, comparison_json, load_engines, markdown_tables, run_comparison
from quickdraft.bench.qd_engine import QuickdraftEngine
from quickdraft.cli import main
from quickdraft.weights import load_model
from tiny_tokenizer import tiny_model, write_llama_gguf


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Charges the clock: `prefill_s` per prefill (a list: one per call, the warm-up's first),
    `token_s` per decoded token after the first, `first_s` for the first, t(q) = `t1` * (1 + slope*(q-1))."""

    def __init__(self, name: str, clock: Clock, log: list, token_s: float, prefill_s: list[float],
                 t1: float, slope: float, first_s: float = 0.5, outputs: dict | None = None) -> None:
        self.name, self.clock, self.log = name, clock, log
        self.token_s, self.prefill_s, self.t1, self.slope, self.first_s = token_s, list(prefill_s), t1, slope, first_s
        self.outputs = outputs or {}
        self.n = 0
        self.context = None

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        self.log.append((self.name, "decode", tuple(prompt)))
        self.clock.now += self.first_s  # the prompt's pass: must not count in the decode rate
        tokens = self.outputs.get(tuple(prompt), list(range(n)))
        for i in range(n):
            if i:
                self.clock.now += self.token_s
            yield tokens[i]

    def prefill(self, tokens: Sequence[int]) -> None:
        self.log.append((self.name, "prefill", len(tokens)))
        self.clock.now += self.prefill_s.pop(0) if len(tokens) == 64 else 0.001 * len(tokens)
        self.n = len(tokens)

    def feed(self, tokens: Sequence[int]) -> None:
        assert self.n == 8, "every t(q) pass starts from the same cached context"
        self.log.append((self.name, "feed", len(tokens)))
        self.clock.now += self.t1 * (1 + self.slope * (len(tokens) - 1))
        self.n += len(tokens)

    def truncate(self, n: int) -> None:
        self.n = n


def config(repeats: int = 3, prompts: int = 2, n: int = 5, prefill: tuple[int, ...] = (64,)) -> CompareConfig:
    return CompareConfig(prompts=tuple((10 + i, 11 + i) for i in range(prompts)), max_new_tokens=n,
                         prefill_ids=tuple(tuple(range(k)) for k in prefill), context_ids=tuple(range(8)), fed_ids=tuple(range(100, 104)),
                         q_values=(1, 2, 3, 4), repeats=repeats)


def engines(log: list, clock: Clock, **ours) -> tuple[list[FakeEngine], list[float]]:
    a = FakeEngine("ours", clock, log, token_s=0.02, prefill_s=[99.0, 2.0, 1.0, 1.5], t1=0.01, slope=0.1, **ours)
    b = FakeEngine("ref", clock, log, token_s=0.01, prefill_s=[99.0, 0.5, 0.5, 4.0], t1=0.02, slope=1.0)
    loads = iter([3.0, 0.25])

    def loader(engine: FakeEngine):
        def load() -> FakeEngine:
            clock.now += next(loads)
            return engine
        return load
    return load_engines([("ours", loader(a)), ("ref", loader(b))], clock)


def test_medians_leave_out_the_warm_up_the_first_token_and_outliers() -> None:
    clock, log = Clock(), []
    result = run_comparison(*engines(log, clock), config(), clock=clock)
    a, b = result.ours, result.theirs
    assert (a.load_s, b.load_s) == (3.0, 0.25)
    assert a.decode_tok_s == pytest.approx([50.0] * 6) and b.decode_median == pytest.approx(100.0)
    assert a.prefill_s == {64: (2.0, 1.0, 1.5)} and b.prefill_s == {64: (0.5, 0.5, 4.0)}  # the 99 s warm-ups are not there
    assert a.prefill_tok_s(64) == pytest.approx(64 / 1.5) and b.prefill_tok_s(64) == pytest.approx(128)
    for q in (1, 2, 3, 4):
        assert len(a.t_q_s[q]) == 3
        assert a.t_q_ratio(q) == pytest.approx(1 + 0.1 * (q - 1)) and b.t_q_ratio(q) == pytest.approx(q)
    j = comparison_json(result)
    assert j["ratios"]["decode"] == pytest.approx(0.5) and j["ratios"]["load"] == pytest.approx(12.0)
    assert j["ratios"]["prefill"] == {"64": pytest.approx((64 / 1.5) / 128)}
    assert j["ratios"]["t_q"]["4"] == pytest.approx(0.013 / 0.08)
    assert j["engines"]["ref"]["t_q_ratio"]["3"] == pytest.approx(3.0)
    assert j["engines"]["ours"]["runs"]["prefill_s"] == {"64": [2.0, 1.0, 1.5]}
    json.dumps(j)  # plain data only


def test_rounds_alternate_which_engine_goes_first_after_both_warm_up() -> None:
    clock, log = Clock(), []
    cfg = config(repeats=2)
    run_comparison(*engines(log, clock), cfg, clock=clock)
    warm = [(e, what) for e, what, _ in log[:2 * (3 + 4)]]
    assert warm == [("ours", "decode"), ("ours", "prefill"), ("ours", "prefill")] + [("ours", "feed")] * 4 + \
                   [("ref", "decode"), ("ref", "prefill"), ("ref", "prefill")] + [("ref", "feed")] * 4
    timed = [(e, what) for e, what, _ in log[14:] if what != "prefill" or _ == 64]
    decodes = [e for e, what in timed if what == "decode"]
    assert decodes == ["ours", "ref", "ours", "ref", "ref", "ours", "ref", "ours"]  # per prompt: A B, then B A
    prefills = [e for e, what in timed if what == "prefill"]
    assert prefills == ["ours", "ref", "ref", "ours"]
    feeds = [(e, n) for e, what, n in log[14:] if what == "feed"]
    assert feeds[:8] == [("ours", 1), ("ours", 2), ("ours", 3), ("ours", 4), ("ref", 1), ("ref", 2), ("ref", 3), ("ref", 4)]
    assert feeds[8:] == [("ref", 4), ("ref", 3), ("ref", 2), ("ref", 1), ("ours", 4), ("ours", 3), ("ours", 2), ("ours", 1)]


def test_table_and_agreement() -> None:
    clock, log = Clock(), []
    outputs = {(10, 11): [0, 1, 2, 9, 9]}  # ours leaves the reference's tokens at position 3 of prompt 1
    result = run_comparison(*engines(log, clock, outputs=outputs), config(), clock=clock)
    assert result.same_prefix() == [3, 5]
    table = markdown_tables(result)
    assert "| | ours | ref | ours / ref |" in table
    assert re.search(r"^\| decode tok/s \(greedy, after the first token\) \| 50\.00 \| 100\.00 \| 0\.50x \|$", table, re.M)
    assert re.search(r"^\| prefill tok/s \(64 tokens\) \| 42\.67 \| 128\.00 \| 0\.33x \|$", table, re.M)
    assert re.search(r"^\| load s \| 3\.00 \| 0\.25 \| 12\.00x \|$", table, re.M)
    assert re.search(r"^\| 4 \| 13\.00 \| 1\.30 \| 80\.00 \| 4\.00 \| 0\.16x \|$", table, re.M)
    assert len(re.findall(r"^\| \d+ \|", table, re.M)) == 4
    assert "per prompt: 3, 5 of 5" in table


def test_each_prefill_length_is_timed_in_every_round_on_both_engines() -> None:
    clock, log = Clock(), []
    result = run_comparison(*engines(log, clock), config(repeats=2, prefill=(64, 20)), clock=clock)
    assert result.prefill_tokens == (64, 20)
    assert result.ours.prefill_s[20] == pytest.approx((0.02, 0.02)) and result.theirs.prefill_s[64] == (0.5, 0.5)
    assert comparison_json(result)["ratios"]["prefill"] == {"64": pytest.approx((64 / 1.5) / 128), "20": pytest.approx(1.0)}
    timed = [(e, n) for e, what, n in log if what == "prefill" and n != 8][4:]  # after each engine's warm-up
    assert timed == [("ours", 64), ("ref", 64), ("ours", 20), ("ref", 20), ("ref", 64), ("ours", 64), ("ref", 20), ("ours", 20)]
    table = markdown_tables(result)
    assert "| prefill tok/s (20 tokens) | 1000.00 | 1000.00 | 1.00x |" in table


@pytest.mark.parametrize("change, message", [
    (dict(max_new_tokens=1), "max_new_tokens must be >= 2"),
    (dict(q_values=(2, 3)), "must include 1"),
    (dict(q_values=(1, 5)), "at most 4"),
    (dict(prompts=((1,), ())), "none of them empty"),
    (dict(repeats=0), "repeats >= 1"),
])
def test_config_is_validated(change: dict, message: str) -> None:
    fields = dict(config().__dict__)
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        CompareConfig(**fields)


def test_without_llama_cpp_the_command_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    # a model that does not exist: the missing extra is reported first, before any slow load
    assert main(["bench", "plain", "--compare-llamacpp", "-m", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "needs the Python package llama_cpp" in err and "pip install -e '.[llamacpp]'" in err


class GreedyLoop:
    """Stands in for llama.cpp: greedy decoding written out over the model's forward, an oracle for
    the quickdraft engine's tokens; passes through the quickdraft engine's own prefill/feed."""
    name = "loop"

    def __init__(self, path: Path, max_len: int) -> None:
        self.inner = QuickdraftEngine(load_model(path), max_len)
        self.prefill, self.feed, self.truncate = self.inner.prefill, self.inner.feed, self.inner.truncate

    def system_info(self) -> str:
        return "greedy loop"

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        model = self.inner.model
        ids = list(prompt)
        for _ in range(n):
            cache = model.new_cache(1, len(ids))
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits
            ids.append(int(logits[0, -1].argmax()))
            yield ids[-1]


def test_command_end_to_end_on_a_tiny_gguf(tmp_path: Path, monkeypatch, capsys) -> None:
    path = write_llama_gguf(tiny_model(), tmp_path / "tiny.gguf")
    monkeypatch.setattr(vs_llamacpp, "import_llama_cpp", lambda: type("lc", (), {"__version__": "fake"}))
    monkeypatch.setattr(vs_llamacpp, "LlamaCppEngine", lambda p, threads, n_ctx, n_batch: GreedyLoop(p, n_ctx))
    args = ["bench", "plain", "--compare-llamacpp", "-m", str(path), "--prompts", "2", "-n", "6", "--repeats", "2",
            "--prefill-tokens", "64,16", "--context", "32", "--max-q", "5", "--threads", "1"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["greedy_same_prefix"] == [6, 6]  # the engine's plain path decodes the model's greedy tokens
    assert res["q_values"] == [1, 2, 3, 4, 5] and res["prefill_tokens"] == [16, 64]
    assert set(res["ratios"]["prefill"]) == {"16", "64"} and "--prefill-tokens 16,64" in res["config"]["command"]
    for engine in ("quickdraft", "loop"):
        e = res["engines"][engine]
        assert e["t_q_ratio"]["1"] == 1.0 and len(e["runs"]["decode_tok_s"]) == 4 and e["load_s"] > 0
        assert e["t_q_ms"]["5"] == pytest.approx(statistics.median(e["runs"]["t_q_s"]["5"]) * 1000)
    assert res["config"]["threads"] == 1 and res["config"]["prompt_tokens"][0] > 10
    assert "isa" in res["config"]["quickdraft_kernel"]  # which path ran is in the record
    assert res["config"]["command"].startswith("quickdraft bench plain --compare-llamacpp -m ")
    assert main(args) == 0
    assert "| decode tok/s (greedy, after the first token) |" in capsys.readouterr().out


def test_command_refuses_a_non_gguf_model_and_several_dtypes(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(vs_llamacpp, "import_llama_cpp", lambda: object())
    (tmp_path / "hf").mkdir()
    assert main(["bench", "plain", "--compare-llamacpp", "-m", str(tmp_path / "hf")]) == 1
    assert "needs a GGUF model" in capsys.readouterr().err
    assert main(["bench", "plain", "--compare-llamacpp", "--dtypes", "float32,bfloat16"]) == 1
    assert "measures one quickdraft dtype" in capsys.readouterr().err
