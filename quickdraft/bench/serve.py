"""`quickdraft bench serve`: the HTTP server under concurrent load, with and without speculation.

One server (in this process, on 127.0.0.1) serves both modes: each request picks its speculation
through the `speculative` body field, so plain and speculative waves run side by side on the same
engine, interleaved (A B, then B A) per concurrency level. A wave sends the same chat requests
(Spec-Bench first turns, greedy), at most `concurrency` in flight, streaming. Reported per level
and mode: total tokens/s (medians over rounds), per-request latency and time to first token, and
whether every request's text is identical in both modes.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from quickdraft.bench.questions import Question
from quickdraft.bench.sse import sse_chunks

MODES = ("plain", "speculative")


@dataclass
class RequestRecord:
    question_id: int | str
    latency_s: float
    ttft_s: float
    tokens: int
    tokens_per_pass: float
    text: str


def stream_chat(url: str, model: str, question: str, max_tokens: int, speculative: dict | None) -> RequestRecord:
    """One streaming chat request; latency and TTFT as the client sees them."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    if speculative is not None:
        body["speculative"] = speculative
    start = time.perf_counter()
    ttft, parts, last = 0.0, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for last in sse_chunks(r, "server"):
            delta = last["choices"][0]["delta"].get("content") or ""
            if delta and not ttft:
                ttft = time.perf_counter() - start
            parts.append(delta)
    latency = time.perf_counter() - start
    return RequestRecord("", latency, ttft, last["usage"]["completion_tokens"], last["stats"]["tokens_per_pass"],
                         "".join(parts))


def run_wave(url: str, model: str, questions: Sequence[Question], concurrency: int, max_tokens: int,
             speculative: dict | None) -> tuple[float, list[RequestRecord]]:
    """All questions with at most `concurrency` requests in flight; returns wall seconds and records."""
    def one(q: Question) -> RequestRecord:
        record = stream_chat(url, model, q.turns[0], max_tokens, speculative)
        record.question_id = q.question_id
        return record

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(one, questions))
    return time.perf_counter() - start, records


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def summarize_level(waves: dict[str, list[tuple[float, list[RequestRecord]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, runs in waves.items():
        records = [r for _, rs in runs for r in rs]
        out[mode] = {
            "tokens_per_s": statistics.median(sum(r.tokens for r in rs) / wall for wall, rs in runs),
            "latency_mean_s": statistics.fmean(r.latency_s for r in records),
            "latency_median_s": statistics.median(r.latency_s for r in records),
            "latency_p90_s": _p90([r.latency_s for r in records]),
            "ttft_median_s": statistics.median(r.ttft_s for r in records),
            "tokens_per_pass": statistics.fmean(r.tokens_per_pass for r in records),
            "requests": len(records), "tokens": sum(r.tokens for r in records),
        }
    plain, spec = out["plain"], out["speculative"]
    out["throughput_ratio"] = spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    out["latency_ratio"] = spec["latency_median_s"] / plain["latency_median_s"] if plain["latency_median_s"] else 0.0
    texts = {mode: {} for mode in waves}
    for mode, runs in waves.items():
        for _, rs in runs:
            for r in rs:
                texts[mode].setdefault(r.question_id, set()).add(r.text)
    same = [texts["plain"][q] == texts["speculative"][q] and len(texts["plain"][q]) == 1 for q in texts["plain"]]
    out["identical"] = sum(same) / len(same) if same else 0.0
    return out


def run_serve_bench(url: str, model: str, questions: Sequence[Question], concurrencies: Sequence[int],
                    rounds: int, max_tokens: int, speculative: dict, progress: bool = True) -> dict[str, Any]:
    """Per concurrency level: `rounds` pairs of waves, plain and speculative in alternating order."""
    levels: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    modes = {"plain": {"method": "none"}, "speculative": speculative}
    total = len(concurrencies) * rounds * 2
    bar = tqdm(total=total, desc="bench serve", unit="wave", disable=not progress)
    run_wave(url, model, questions[:1], 1, 8, speculative)  # warm-up: kernels built, caches touched
    for c in concurrencies:
        waves: dict[str, list] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                waves[mode].append(run_wave(url, model, questions, c, max_tokens, modes[mode]))
                bar.update(1)
        levels[str(c)] = summarize_level(waves)
        raw[str(c)] = {mode: [{"wall_s": wall, "requests": [asdict(r) for r in rs]} for wall, rs in runs]
                       for mode, runs in waves.items()}
    bar.close()
    return {"levels": levels, "raw": raw}


def markdown_table(results: dict[str, Any]) -> str:
    lines = ["| concurrency | mode | tokens/s | ratio | latency median (s) | p90 (s) | TTFT median (s) | tokens/pass | identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, level in results["levels"].items():
        for mode in MODES:
            s = level[mode]
            ratio = f"{level['throughput_ratio']:.2f}x" if mode == "speculative" else ""
            same = f"{level['identical']:.0%}" if mode == "speculative" else ""
            lines.append(f"| {c} | {mode} | {s['tokens_per_s']:.1f} | {ratio} | {s['latency_median_s']:.2f} | "
                         f"{s['latency_p90_s']:.2f} | {s['ttft_median_s']:.2f} | {s['tokens_per_pass']:.2f} | {same} |")
    return "\n".join(lines) + "\n"
