"""Two engines measured side by side on the same token ids: the schedule and the report of
`quickdraft bench plain --compare-llamacpp`.

Owns when things are timed (loads, a warm-up, rounds alternating which engine goes first, A B then
B A, so drift hits both; medians) and the table and JSON. Knows engines only through
`BenchEngine`, so it is tested with fake engines and a fake clock; knows no model or library.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

Clock = Callable[[], float]


class BenchEngine(Protocol):
    name: str

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        """Greedy decoding from an empty cache: yield each of n new tokens as soon as it exists
        (end-of-sequence ignored)."""

    def prefill(self, tokens: Sequence[int]) -> None:
        """Empty the cache, then one pass over `tokens` (logits of the last one only)."""

    def feed(self, tokens: Sequence[int]) -> None:
        """One pass over `tokens` after those cached, logits for every one (as verification needs)."""

    def truncate(self, n: int) -> None:
        """Drop all but the first n cached tokens."""


@dataclass(frozen=True)
class CompareConfig:
    prompts: tuple[tuple[int, ...], ...]   # token ids, the same for both engines
    max_new_tokens: int                    # per decode run
    prefill_ids: tuple[tuple[int, ...], ...]  # the prompts of the prefill measurements, one per length
    context_ids: tuple[int, ...]           # cached before each t(q) pass
    fed_ids: tuple[int, ...]               # a pass for q feeds the first q of these
    q_values: tuple[int, ...]
    repeats: int                           # timed rounds after the warm-up

    def __post_init__(self) -> None:
        if not self.prompts or any(not p for p in self.prompts):
            raise ValueError("expected at least one prompt, none of them empty")
        if self.max_new_tokens < 2:  # the decode rate is timed from the first token to the last
            raise ValueError(f"max_new_tokens must be >= 2, found {self.max_new_tokens}")
        if not self.prefill_ids or not all(self.prefill_ids) or not self.context_ids or self.repeats < 1:
            raise ValueError("expected prefill and context tokens and repeats >= 1")
        if len({len(p) for p in self.prefill_ids}) != len(self.prefill_ids):
            raise ValueError("expected prefill prompts of distinct lengths")
        if not self.q_values or 1 not in self.q_values or max(self.q_values) > len(self.fed_ids):
            raise ValueError(f"q values must include 1 and be at most {len(self.fed_ids)} (the fed tokens), "
                             f"found {list(self.q_values)}")


@dataclass(frozen=True)
class EngineResult:
    name: str
    load_s: float
    decode_tok_s: tuple[float, ...]   # one per (round, prompt)
    prefill_s: dict[int, tuple[float, ...]]  # prompt length -> one per round
    t_q_s: dict[int, tuple[float, ...]]  # q -> one per round
    outputs: tuple[tuple[int, ...], ...]  # the greedy tokens per prompt (first timed round)

    @property
    def decode_median(self) -> float:
        return statistics.median(self.decode_tok_s)

    def prefill_tok_s(self, n_tokens: int) -> float:
        return n_tokens / statistics.median(self.prefill_s[n_tokens])

    def t_q_median(self, q: int) -> float:
        return statistics.median(self.t_q_s[q])

    def t_q_ratio(self, q: int) -> float:
        """median t(q) / median t(1)"""
        return self.t_q_median(q) / self.t_q_median(1)


@dataclass(frozen=True)
class Comparison:
    config: dict            # what was run (model, threads, command, ...), echoed in the report
    prefill_tokens: tuple[int, ...]
    q_values: tuple[int, ...]
    ours: EngineResult
    theirs: EngineResult

    def same_prefix(self) -> list[int]:
        """Per prompt: how many greedy tokens the two engines agree on before their first difference."""
        def common(a: Sequence[int], b: Sequence[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return [common(a, b) for a, b in zip(self.ours.outputs, self.theirs.outputs)]


def _decode_rate(engine: BenchEngine, prompt: Sequence[int], n: int, clock: Clock) -> tuple[float, list[int]]:
    """Tokens per second after the first token (so the prompt's pass is not counted), and the tokens."""
    tokens, first = [], 0.0
    for token in engine.stream_greedy(prompt, n):
        tokens.append(token)
        if len(tokens) == 1:
            first = clock()
    end = clock()
    if len(tokens) != n:
        raise RuntimeError(f"{engine.name} yielded {len(tokens)} tokens, expected {n}")
    return (n - 1) / (end - first), tokens


def _timed(clock: Clock, fn: Callable[[], None]) -> float:
    start = clock()
    fn()
    return clock() - start


def _q_sweep(engine: BenchEngine, cfg: CompareConfig, reverse: bool, clock: Clock) -> dict[int, float]:
    """One pass per q over the same cached context; the fed tokens are dropped again after each."""
    engine.prefill(cfg.context_ids)
    n = len(cfg.context_ids)
    times = {}
    for q in sorted(cfg.q_values, reverse=reverse):
        times[q] = _timed(clock, lambda q=q: engine.feed(cfg.fed_ids[:q]))
        engine.truncate(n)
    return times


def load_engines(loaders: Sequence[tuple[str, Callable[[], BenchEngine]]], clock: Clock = time.perf_counter,
                 log: Callable[[str], None] = lambda _: None) -> tuple[list[BenchEngine], list[float]]:
    """Each engine loaded once, in order, timed."""
    engines, load_s = [], []
    for name, loader in loaders:
        log(f"loading {name}")
        start = clock()
        engines.append(loader())
        load_s.append(clock() - start)
    return engines, load_s


@dataclass
class _Samples:
    """One engine's measurements as the rounds produce them."""
    decode: list[float] = field(default_factory=list)
    outputs: list[tuple[int, ...]] = field(default_factory=list)
    prefill: dict[int, list[float]] = field(default_factory=dict)
    t_q: dict[int, list[float]] = field(default_factory=dict)

    def result(self, name: str, load_s: float) -> EngineResult:
        return EngineResult(name, load_s, tuple(self.decode), {n: tuple(ts) for n, ts in sorted(self.prefill.items())},
                            {q: tuple(ts) for q, ts in sorted(self.t_q.items())}, tuple(self.outputs))


def _round(engines: Sequence[BenchEngine], samples: Sequence[_Samples], cfg: CompareConfig, r: int,
           clock: Clock) -> None:
    order = [0, 1] if r % 2 == 0 else [1, 0]
    for prompt in cfg.prompts:
        for i in order:
            rate, tokens = _decode_rate(engines[i], prompt, cfg.max_new_tokens, clock)
            samples[i].decode.append(rate)
            if r == 0:
                samples[i].outputs.append(tuple(tokens))
    for ids in cfg.prefill_ids:
        for i in order:
            samples[i].prefill.setdefault(len(ids), []).append(_timed(clock, lambda i=i, ids=ids: engines[i].prefill(ids)))
    for i in order:
        for q, s in _q_sweep(engines[i], cfg, r % 2 == 1, clock).items():
            samples[i].t_q.setdefault(q, []).append(s)


def run_comparison(engines: Sequence[BenchEngine], load_s: Sequence[float], cfg: CompareConfig,
                   config: dict | None = None, clock: Clock = time.perf_counter,
                   log: Callable[[str], None] = lambda _: None) -> Comparison:
    """Warm each engine up once through every measurement, then `cfg.repeats` rounds; in each,
    every measurement runs on both engines back to back, the first engine first in even rounds and
    second in odd ones (A B, then B A)."""
    assert len(engines) == len(load_s) == 2, "a comparison is of two engines: ours, then the reference"
    for e in engines:
        log(f"warming up {e.name}")
        _decode_rate(e, cfg.prompts[0], min(8, cfg.max_new_tokens), clock)
        for ids in cfg.prefill_ids:
            e.prefill(ids)
        _q_sweep(e, cfg, False, clock)
    samples = [_Samples(), _Samples()]
    for r in range(cfg.repeats):
        log(f"round {r + 1}/{cfg.repeats}")
        _round(engines, samples, cfg, r, clock)
    ours, theirs = (s.result(e.name, t) for s, e, t in zip(samples, engines, load_s))
    return Comparison(dict(config or {}), tuple(len(p) for p in cfg.prefill_ids), tuple(sorted(cfg.q_values)), ours,
                      theirs)


def markdown_tables(c: Comparison) -> str:
    a, b = c.ours, c.theirs
    rows = [("decode tok/s (greedy, after the first token)", a.decode_median, b.decode_median),
            *((f"prefill tok/s ({n} tokens)", a.prefill_tok_s(n), b.prefill_tok_s(n)) for n in c.prefill_tokens),
            ("load s", a.load_s, b.load_s)]
    lines = [f"| | {a.name} | {b.name} | {a.name} / {b.name} |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {x:.2f} | {y:.2f} | {x / y:.2f}x |" for label, x, y in rows]
    lines += ["", f"| q | {a.name} t(q) ms | {a.name} t(q)/t(1) | {b.name} t(q) ms | {b.name} t(q)/t(1) "
                  f"| t(q) {a.name} / {b.name} |", "|---:|---:|---:|---:|---:|---:|"]
    for q in c.q_values:
        ta, tb = a.t_q_median(q), b.t_q_median(q)
        lines.append(f"| {q} | {ta * 1000:.2f} | {a.t_q_ratio(q):.2f} | {tb * 1000:.2f} | "
                     f"{b.t_q_ratio(q):.2f} | {ta / tb:.2f}x |")
    same = c.same_prefix()
    lines += ["", f"Medians: decode of {len(a.decode_tok_s)} runs per engine, prefill and t(q) of "
                  f"{len(a.t_q_s[1])}; load once each. Greedy tokens identical before the first "
                  f"difference, per prompt: {', '.join(map(str, same))} of {len(a.outputs[0])}. "
                  f"A ratio is {a.name}'s figure over {b.name}'s: above 1 is better for tok/s, worse for "
                  f"seconds and t(q)."]
    return "\n".join(lines) + "\n"


def _engine_json(e: EngineResult) -> dict:
    return {"load_s": e.load_s, "decode_tok_s": e.decode_median,
            "prefill_tok_s": {str(n): e.prefill_tok_s(n) for n in e.prefill_s},
            "t_q_ms": {str(q): e.t_q_median(q) * 1000 for q in e.t_q_s},
            "t_q_ratio": {str(q): e.t_q_ratio(q) for q in e.t_q_s},
            "runs": {"decode_tok_s": list(e.decode_tok_s), "prefill_s": {str(n): list(ts) for n, ts in e.prefill_s.items()},
                     "t_q_s": {str(q): list(ts) for q, ts in e.t_q_s.items()}}}


def comparison_json(c: Comparison) -> dict:
    a, b = c.ours, c.theirs
    return {"config": c.config, "prefill_tokens": list(c.prefill_tokens), "q_values": list(c.q_values),
            "engines": {a.name: _engine_json(a), b.name: _engine_json(b)},
            "ratios": {"decode": a.decode_median / b.decode_median,
                       "prefill": {str(n): a.prefill_tok_s(n) / b.prefill_tok_s(n) for n in c.prefill_tokens},
                       "load": a.load_s / b.load_s,
                       "t_q": {str(q): a.t_q_median(q) / b.t_q_median(q) for q in c.q_values}},
            "greedy_same_prefix": c.same_prefix()}
