"""`quickdraft bench serve`: the HTTP server under concurrent load, with and without speculation.

One server (in this process, on 127.0.0.1) serves both modes: each request picks its speculation
through the `speculative` body field, so plain and speculative waves run side by side on the same
engine, interleaved (A B, then B A) per concurrency level. A wave sends the same chat requests
(Spec-Bench first turns, greedy), at most `concurrency` in flight, streaming. Reported per level
and mode: total tokens/s (medians over rounds), per-request latency and time to first token, and
whether every request's text is identical in both modes.

With --replicas N,M,...: the same waves against `quickdraft serve --replicas N` (a process of its
own; 1: one process, no Ray), one count after the other, each with its per-replica load (read from
/metrics after the warm-up and after the waves), its tokens/s over the first count's and whether
its texts are the first count's.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import httpx
from tqdm import tqdm

from quickdraft.bench.multiturn_targets import ServerProcess, free_port
from quickdraft.bench.questions import Question
from quickdraft.bench.sse import sse_chunks
from quickdraft.cluster.load import ReplicaLoad, load_between, load_table, replica_loads

MODES = ("plain", "speculative")


@dataclass
class RequestRecord:
    question_id: int | str
    latency_s: float
    ttft_s: float
    tokens: int
    tokens_per_pass: float
    text: str


def stream_chat(client: httpx.Client, url: str, model: str, question: str, max_tokens: int,
                speculative: dict | None) -> RequestRecord:
    """One streaming chat request; latency and TTFT as the client sees them."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    if speculative is not None:
        body["speculative"] = speculative
    start = time.perf_counter()
    ttft, parts, last = 0.0, [], {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
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
    """All questions with at most `concurrency` requests in flight; returns wall seconds and records.
    One client for them all: a client of its own per request (httpx.stream) costs ~23 ms of CPU to
    make (its TLS context), taken from the server measured on the same cores."""
    def one(q: Question) -> RequestRecord:
        record = stream_chat(client, url, model, q.turns[0], max_tokens, speculative)
        record.question_id = q.question_id
        return record

    with httpx.Client() as client:
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
    if "speculative" not in out:  # plain waves only (--spec none with --replicas)
        return out
    plain, spec = out["plain"], out["speculative"]
    out["throughput_ratio"] = spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    out["latency_ratio"] = spec["latency_median_s"] / plain["latency_median_s"] if plain["latency_median_s"] else 0.0
    texts = {mode: texts_by_question([r for _, rs in runs for r in rs]) for mode, runs in waves.items()}
    out["identical"] = same_share(texts["plain"], texts["speculative"])
    return out


def texts_by_question(records: Sequence[RequestRecord | dict[str, Any]]) -> dict[Any, set[str]]:
    """Question id -> the texts its requests got (one, where greedy answers are the same each time)."""
    texts: dict[Any, set[str]] = {}
    for r in records:
        r = r if isinstance(r, dict) else asdict(r)
        texts.setdefault(r["question_id"], set()).add(r["text"])
    return texts


def same_share(a: dict[Any, set[str]], b: dict[Any, set[str]]) -> float:
    """The share of a's questions whose one text is b's one text."""
    same = [a[q] == b.get(q) and len(a[q]) == 1 for q in a]
    return sum(same) / len(same) if same else 0.0


def run_serve_bench(url: str, model: str, questions: Sequence[Question], concurrencies: Sequence[int],
                    rounds: int, max_tokens: int, speculative: dict | None, progress: bool = True,
                    warmed: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Per concurrency level: `rounds` pairs of waves, plain and speculative in alternating order
    (plain waves alone where `speculative` is None). `warmed` is called after the warm-up request."""
    levels: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    modes = {"plain": {"method": "none"}, **({"speculative": speculative} if speculative is not None else {})}
    order = tuple(modes)
    total = len(concurrencies) * rounds * len(modes)
    bar = tqdm(total=total, desc="bench serve", unit="wave", disable=not progress)
    run_wave(url, model, questions[:1], 1, 8, speculative)  # warm-up: kernels built, caches touched
    warmed()
    for c in concurrencies:
        waves: dict[str, list] = {mode: [] for mode in modes}
        for r in range(rounds):
            for mode in (order if r % 2 == 0 else order[::-1]):
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
        for mode in (m for m in MODES if m in level):
            s = level[mode]
            ratio = f"{level['throughput_ratio']:.2f}x" if mode == "speculative" else ""
            same = f"{level['identical']:.0%}" if mode == "speculative" else ""
            lines.append(f"| {c} | {mode} | {s['tokens_per_s']:.1f} | {ratio} | {s['latency_median_s']:.2f} | "
                         f"{s['latency_p90_s']:.2f} | {s['ttft_median_s']:.2f} | {s['tokens_per_pass']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


# -- --replicas: the same waves against `quickdraft serve --replicas N`, one count after another ----------

SERVED_NAME = "bench"


def serve_command(flags: Sequence[str], replicas: int, router: str, port: int) -> list[str]:
    """`quickdraft serve` with the bench's `flags` (model, engine, speculation) on 127.0.0.1:port:
    one process for 1 replica, else N replicas on Ray behind `router`."""
    cmd = [sys.executable, "-m", "quickdraft", "serve", *flags, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    return cmd + (["--replicas", str(replicas), "--router", router] if replicas > 1 else [])


@contextmanager
def started(flags: Sequence[str], replicas: int, router: str, log_dir: Path) -> Iterator[str]:
    """The server of `replicas` in a process of its own, up (its /health 200) until the block ends."""
    port = free_port()
    with ServerProcess(serve_command(flags, replicas, router, port), port, dict(os.environ),
                       log_dir / f"serve-{replicas}.log") as server:
        yield server.url


def read_loads(url: str) -> dict[str, ReplicaLoad]:
    return replica_loads(httpx.get(f"{url}/metrics", timeout=60).text)


def run_on_replicas(counts: Sequence[int], start: Callable[[int], ContextManager[str]],
                    bench: Callable[[str, Callable[[], None]], dict[str, Any]]) -> dict[str, Any]:
    """Each replica count in turn: its server started (`start`), the waves run (`bench(url, warmed)`,
    which calls `warmed` after its warm-up), each replica's load between the warm-up and the end,
    and what the server's /health says it runs; then every count against the first."""
    runs: dict[str, Any] = {}
    for n in counts:
        with start(n) as url:
            readings: list[dict[str, ReplicaLoad]] = []
            results = bench(url, lambda readings=readings: readings.append(read_loads(url)))
            load = load_between(readings[0], read_loads(url))
            health = httpx.get(f"{url}/health", timeout=60).json()
        runs[str(n)] = {**results, "load": {replica: lo.as_dict() for replica, lo in load.items()}, "server": health}
    base = str(counts[0])
    return {"replicas": runs, "base": base, "against_base": {n: against(run, runs[base]) for n, run in runs.items()}}


def against(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per level and mode: tokens/s over the base run's, and the share of questions answered with the
    base run's text."""
    def texts(r: dict[str, Any], c: str, mode: str) -> dict[Any, set[str]]:
        return texts_by_question([q for wave in r["raw"][c][mode] for q in wave["requests"]])

    out: dict[str, Any] = {}
    for c, level in run["levels"].items():
        out[c] = {mode: {"tokens_per_s_ratio": (level[mode]["tokens_per_s"] / base["levels"][c][mode]["tokens_per_s"]
                                                if base["levels"][c][mode]["tokens_per_s"] else 0.0),
                         "identical": same_share(texts(run, c, mode), texts(base, c, mode))}
                  for mode in MODES if mode in level}
    return out


def replicas_report(results: dict[str, Any]) -> str:
    """Each count's table and per-replica load, then each count against the first."""
    base, out = results["base"], []
    for n, run in results["replicas"].items():
        out += [f"### {n} replica{'s' if n != '1' else ''}{' (one process)' if n == '1' else ''}", "",
                markdown_table(run), "Per replica, after the warm-up:", "", load_table(run["load"])]
    out += [f"Against {base} replica{'s' if base != '1' else ''}:", "",
            "| replicas | concurrency | mode | tokens/s ratio | same text |", "|---:|---:|---|---:|---:|"]
    for n, levels in results["against_base"].items():
        if n != base:
            out += [f"| {n} | {c} | {mode} | {r['tokens_per_s_ratio']:.2f}x | {r['identical']:.0%} |"
                    for c, modes in levels.items() for mode, r in modes.items()]
    return "\n".join(out) + "\n"
