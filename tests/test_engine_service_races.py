"""The model's one engine service (engine/service.py) under attack: callers that misbehave (a sink
that raises, a stream dropped mid-way), admissions that fail, callers that wait while another
thread drives, a server stopped with generate calls in flight, a cache that grows while rows come
and go.

Oracles: each request's output alone, from a fresh engine of its own (generate_tokens, no prefix
cache); a deadline for every call that could hang; the waiting thread's own CPU time.
"""
from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator, TypeVar

import httpx
import pytest
import torch

import quickdraft
from quickdraft import SamplingParams
from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.events import TokenEvent
from quickdraft.engine.loop import generate_tokens
from quickdraft.kv.cache import KVCache
from quickdraft.proposers import SpecConfig
from quickdraft.server import BackgroundServer, ServerConfig
from tiny_tokenizer import tiny_llm_dir

T = TypeVar("T")
PROMPTS = ["the cat sat on the mat", "hello hello hello", "a b c d e f g", "one two three one two"]
DEADLINE_S = 60.0  # a call that takes longer hangs (each of these takes well under a second alone)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    return quickdraft.load(tiny_llm_dir(tmp_path_factory.mktemp("races") / "model"))


def alone(llm: quickdraft.LLM, prompt: str, params: SamplingParams) -> list[int]:
    """The request's tokens from an engine of its own, with no prefix cache."""
    ids = llm.tokenizer.encode(prompt)
    return [t for e in generate_tokens(llm.model, ids, params, llm.tokenizer.eos_token_ids) for t in e.token_ids]


def within(call: Callable[[], T], seconds: float = DEADLINE_S) -> T:
    """call() on a thread of its own; fails (rather than hangs) if it has not returned in time."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not return within {seconds:g} s (a hang)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_sink_that_raises_ends_only_its_own_request(llm: quickdraft.LLM) -> None:
    """A sink is a caller's code run on whichever thread drives: its failure must not reach that
    thread's own generate, nor lose the other requests' events of that step."""
    service = llm.engine_service()
    told: list[TokenEvent] = []

    def broken(event: TokenEvent) -> None:
        told.append(event)
        raise RuntimeError("a consumer's bug")

    params = SamplingParams(max_new_tokens=12)
    request, make = llm.request(llm.tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=40, ignore_eos=True),
                                SpecConfig(method="none"))
    service.submit(request, broken, make)
    got = within(lambda: llm.generate(PROMPTS[1], params=params))
    assert got.token_ids == alone(llm, PROMPTS[1], params)
    assert len(told) == 1, "the request whose sink failed went on decoding"
    assert not service.busy()


def test_a_request_whose_cache_cannot_grow_ends_with_the_error(llm: quickdraft.LLM,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing the K/V cache at admission may fail (out of memory): that request ends with the
    error, its caller is told, and the engine serves the next one."""
    service = llm.engine_service(EngineConfig(max_batch=2))  # a fresh engine: its cache has not grown
    grow = KVCache.reserve

    def out_of_memory(self: KVCache, batch_size: int, max_len: int) -> None:
        raise RuntimeError("out of memory (growing the K/V cache)")

    monkeypatch.setattr(KVCache, "reserve", out_of_memory)
    params = SamplingParams(max_new_tokens=8)
    with pytest.raises(RuntimeError, match="out of memory"):
        within(lambda: llm.generate(PROMPTS[2], params=params))
    assert not service.busy()
    monkeypatch.setattr(KVCache, "reserve", grow)
    assert within(lambda: llm.generate(PROMPTS[2], params=params)).token_ids == alone(llm, PROMPTS[2], params)


def test_a_cache_that_fails_to_grow_is_left_as_it_was(llm: quickdraft.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that allocates (CUDA's, or where no reservation is to be had) and cannot grow."""
    monkeypatch.setattr(quickdraft.kv.blocks, "reservation", lambda *args: None)
    cache = llm.model.new_cache(1, 4)
    assert not cache.pool.reserved
    c = llm.model.config
    cache.write_rows(0, 0, torch.randn(c.num_layers, 2, c.num_kv_heads, 4, c.head_dim))
    before, pool = cache.read(0, 0, 4), cache.pool.kv

    def fails(*args, **kwargs) -> torch.Tensor:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(quickdraft.kv.blocks, "zeros", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.reserve(2, 80)
    assert (cache.batch_size, cache.max_len, tuple(cache.tables.shape)) == (1, 4, (1, 1))
    assert cache.pool.kv is pool and torch.equal(cache.read(0, 0, 4), before)


SYSTEM = "you are a cat you sat on the mat one two three a b c d e f g " * 2  # > 2 prefix-cache blocks


def test_many_threads_at_once_each_get_their_output_alone(llm: quickdraft.LLM, tmp_path_factory) -> None:
    """More threads than rows, plain and speculative (chains, trees, a draft model equal to the
    target), greedy and seeded, some stopping early, prompts sharing a prefix the cache holds:
    each greedy request's tokens are its tokens alone, each seeded one's those it had when run by
    itself; the cache grows, never past max_batch rows of max_seq_len + pad slots."""
    service = llm.engine_service(EngineConfig(max_batch=3, max_seq_len=160))
    draft_dir = str(llm.loaded.source.path)
    specs = [SpecConfig(method="none"), SpecConfig(method="ngram", k=4), SpecConfig(method="ngram-tree", k=6),
             SpecConfig(method="suffix", k=3), SpecConfig(method="draft", k=4, draft_model=draft_dir)]
    jobs = []  # (prompt, params, spec, chunks to read before stopping or None)
    for i in range(10):
        prompt = SYSTEM + PROMPTS[i % len(PROMPTS)] + f" {i}"
        greedy = i % 3 != 2
        params = SamplingParams(max_new_tokens=10 + 7 * (i % 4), ignore_eos=True,
                                temperature=0.0 if greedy else 0.9, seed=None if greedy else i)
        spec = specs[i % len(specs)]
        if not greedy and spec.method == "suffix":  # its drafts come from every earlier answer: a
            spec = SpecConfig(method="ngram", k=2)  # seeded row's tokens follow them
        jobs.append((prompt, params, spec, 3 if i % 4 == 3 else None))

    def run(job) -> list[int]:
        prompt, params, spec, stop_after = job
        tokens = []
        stream = llm.stream(prompt, params=params, spec=spec)
        for n, chunk in enumerate(stream, 1):
            tokens += chunk.token_ids
            if n == stop_after:
                stream.close()
        return tokens

    by_itself = [within(lambda job=job: run(job)) for job in jobs]  # one at a time, through the same engine
    start = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = within(lambda: list(pool.map(lambda job: (start.wait(), run(job))[1], jobs)), 240)
    for (prompt, params, spec, stop_after), first, got in zip(jobs, by_itself, together):
        expected = alone(llm, prompt, params) if params.greedy else first
        if stop_after is None:
            assert got == expected, (spec.method, params)
        else:
            assert got == expected[:len(got)] and got, (spec.method, params)
    cache = service.engine.cache
    assert cache.batch_size <= 3 and cache.max_len <= 160 + service.engine.pad
    assert not service.busy()


@contextmanager
def another_thread_drives(llm: quickdraft.LLM, first: SamplingParams) -> Iterator[threading.Event]:
    """A pool thread generates PROMPTS[1] with `first`, holding the wheel after its first step
    (between the step and its events) until the yielded event is set."""
    service = llm.engine_service()
    inside, release = threading.Event(), threading.Event()

    def hold(_seconds: float) -> None:
        if threading.current_thread() is not threading.main_thread() and not inside.is_set():
            inside.set()
            release.wait(DEADLINE_S)

    service.step_observers.append(hold)
    try:
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(llm.generate, PROMPTS[1], params=first)
            assert inside.wait(DEADLINE_S)
            yield release
            release.set()
            other.result(DEADLINE_S)
    finally:
        service.step_observers.remove(hold)


def test_a_stream_closed_while_another_thread_drives_frees_its_row(llm: quickdraft.LLM) -> None:
    """The closing thread cannot take the cancel in while another drives; the driver must, even
    when its own request ends in that very step and it leaves."""
    stream = llm.stream(PROMPTS[0], params=SamplingParams(max_new_tokens=100, ignore_eos=True))
    next(stream)
    with another_thread_drives(llm, SamplingParams(max_new_tokens=1)):
        stream.close()  # the cancel waits in the inbox
    assert not llm.engine_service().busy(), "the closed stream's request still holds a row: nobody took its cancel in"


def test_a_caller_waiting_while_another_thread_drives_burns_no_core(llm: quickdraft.LLM) -> None:
    with another_thread_drives(llm, SamplingParams(max_new_tokens=2)) as release:
        threading.Timer(1.0, release.set).start()
        cpu, wall = time.thread_time(), time.perf_counter()
        mine = llm.generate(PROMPTS[0], params=SamplingParams(max_new_tokens=1))
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert mine.token_ids == alone(llm, PROMPTS[0], SamplingParams(max_new_tokens=1))
    assert wall >= 0.9 and cpu < 0.25 * wall, f"waited {wall:.2f} s using {cpu:.2f} s of CPU"


def test_stopping_a_server_lets_generate_calls_in_flight_finish(llm: quickdraft.LLM) -> None:
    """The server's loop drove every step; once it stops, the notebook's callers drive their own."""
    config = ServerConfig("tiny", engine=EngineConfig(max_batch=4, max_seq_len=256))
    server = BackgroundServer(llm, config, shutdown_timeout_s=20)
    service = llm.engine_service()
    slow = lambda _s: time.sleep(0.01)
    service.step_observers.append(slow)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0}
    try:
        with ThreadPoolExecutor(4) as pool:
            direct = [pool.submit(llm.generate, p, params=params) for p in PROMPTS[:3]]
            http = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=DEADLINE_S)
            deadline = time.monotonic() + DEADLINE_S
            while service.engine.num_running < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert service.engine.num_running == 4
            within(server.stop)  # waits for the HTTP request in flight, not for generate
            assert not all(d.done() for d in direct), "the stop came too late to test anything"
            got = [d.result(DEADLINE_S).token_ids for d in direct]
            answer = http.result(DEADLINE_S)
    finally:
        service.step_observers.remove(slow)
    assert got == [alone(llm, p, params) for p in PROMPTS[:3]]
    assert answer.status_code == 200, answer.text
    text = llm.tokenizer.decode(alone(llm, PROMPTS[3], replace(params, max_new_tokens=40)))
    assert answer.json()["choices"][0]["text"] == text
    assert not service.busy()


def test_a_stream_dropped_mid_way_frees_its_row(llm: quickdraft.LLM) -> None:
    """Neither closed nor read to its end: garbage collected (here, while another thread drives),
    or left by a consumer that raised."""
    service = llm.engine_service()
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(llm.generate, PROMPTS[1], params=SamplingParams(max_new_tokens=60, ignore_eos=True))
        dropped = llm.stream(PROMPTS[0] + " dropped", params=params)
        next(dropped)
        del dropped
        gc.collect()
        other.result(DEADLINE_S)
    assert not service.busy(), "a garbage-collected stream's request holds a row"

    def consume() -> None:
        for _ in llm.stream(PROMPTS[2] + " raised", params=params):
            raise KeyError("the consumer's bug")

    with pytest.raises(KeyError):
        consume()
    assert not service.busy(), "the stream its consumer left by raising holds a row"


def test_an_engine_made_inside_inference_mode_serves_outside_it(llm: quickdraft.LLM) -> None:
    fresh = quickdraft.load(llm.loaded.source.path)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    with torch.inference_mode():
        first = fresh.generate(SYSTEM, params=params)  # the engine, its cache and prefix blocks made here
        stream = fresh.stream(SYSTEM + " more", params=params)
        next(stream)
    stream.close()  # its row freed (cache rows copied) and offered to the prefix cache outside
    again = fresh.generate(SYSTEM + PROMPTS[1] * 8, params=params)  # grows the cache, hits the prefix cache
    assert first.token_ids == alone(fresh, SYSTEM, params)
    assert again.token_ids == alone(fresh, SYSTEM + PROMPTS[1] * 8, params) and again.stats.cached_tokens >= 16
