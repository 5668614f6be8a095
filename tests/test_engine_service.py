"""One engine per loaded model (engine/service.py): every LLM.generate, from any thread, and a
server over the same LLM go through it; a caller drives it while no one else does.

Oracles: each request's greedy output alone, from a fresh engine of its own (generate_tokens);
the engine's own row counts, seen by a step observer; the prefix cache's stats.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.loop import generate_tokens
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import SpecConfig
from quickdraft.server import BackgroundServer, ServerConfig
from tiny_tokenizer import tiny_llm_dir

PROMPTS = ["the cat sat on the mat", "hello hello hello", "a b c d e f g", "one two three one two"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    return quickdraft.load(tiny_llm_dir(tmp_path_factory.mktemp("service") / "model"))


def alone(llm: quickdraft.LLM, prompt: str, n: int) -> list[int]:
    """The request's greedy tokens from an engine of its own, with no prefix cache."""
    ids = llm.tokenizer.encode(prompt)
    return [t for e in generate_tokens(llm.model, ids, SamplingParams(max_new_tokens=n), llm.tokenizer.eos_token_ids)
            for t in e.token_ids]


def widest_batch(llm: quickdraft.LLM) -> tuple[list[int], callable]:
    """Rows running after each step of the model's engine, from now until the returned call."""
    service = llm.engine_service()
    seen: list[int] = []
    observe = lambda _s: seen.append(service.engine.num_running)
    service.step_observers.append(observe)
    return seen, lambda: service.step_observers.remove(observe)


def test_threads_generating_at_once_share_one_batch(llm: quickdraft.LLM) -> None:
    n = 24
    expected = [alone(llm, p, n) for p in PROMPTS]
    seen, done = widest_batch(llm)
    start = threading.Barrier(len(PROMPTS))

    def run(prompt: str) -> list[int]:
        start.wait()
        return llm.generate(prompt, params=SamplingParams(max_new_tokens=n, ignore_eos=True),
                            spec=SpecConfig(method="ngram", k=4)).token_ids

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(run, PROMPTS))
    finally:
        done()
    assert [g[:len(e)] for g, e in zip(got, expected)] == expected
    assert max(seen) >= 2, f"the threads ran one at a time (rows per step: {seen})"
    assert not llm.engine_service().busy()


def test_generate_beside_a_running_server_shares_its_engine(llm: quickdraft.LLM) -> None:
    config = ServerConfig("tiny", engine=EngineConfig(max_batch=4, max_seq_len=256))
    server = BackgroundServer(llm, config)
    try:
        assert server.worker.service is llm.engine_service()
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            http = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            direct = llm.generate(PROMPTS[1], params=SamplingParams(max_new_tokens=16))
            answer = http.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == llm.tokenizer.decode(alone(llm, PROMPTS[0], 16))
        assert direct.token_ids == alone(llm, PROMPTS[1], 16)
    finally:
        server.stop()
    # the server is gone; the model's engine (its rows and context) serves generate on its own
    assert llm.generate(PROMPTS[2], params=SamplingParams(max_new_tokens=8)).token_ids == alone(llm, PROMPTS[2], 8)


def test_a_consumer_that_stops_early_frees_its_row_and_leaves_its_tokens(llm: quickdraft.LLM) -> None:
    service = llm.engine_service()
    prompt = "stop early " * 6
    stream = llm.stream(prompt, params=SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert not service.busy(), "the cancelled request still holds a row"
    again = llm.generate(prompt, params=SamplingParams(max_new_tokens=4))
    assert again.stats.cached_tokens >= 16, "the stopped request's prompt was not left to the prefix cache"


def test_the_cache_grows_with_requests_not_with_the_context(tmp_path: Path) -> None:
    llm = quickdraft.load(tiny_llm_dir(tmp_path / "model", max_position_embeddings=4096))
    context = llm.model.config.max_position_embeddings
    engine = llm.engine_service().engine
    llm.generate("short", params=SamplingParams(max_new_tokens=4))
    small = engine.cache.max_len
    assert small < context // 8
    long = llm.generate("x " * 40, params=SamplingParams(max_new_tokens=300, ignore_eos=True))
    assert engine.cache.max_len >= len(llm.tokenizer.encode("x " * 40)) + 300 > small
    assert long.token_ids == alone(llm, "x " * 40, 300)[:len(long.token_ids)]


def test_setting_up_a_busy_engine_anew_is_refused(llm: quickdraft.LLM) -> None:
    stream = llm.stream("busy " * 4, params=SamplingParams(max_new_tokens=50, ignore_eos=True))
    next(stream)
    try:
        with pytest.raises(QuickdraftError, match="running requests"):
            llm.engine_service(EngineConfig(max_batch=3))
    finally:
        stream.close()
    assert llm.engine_service(EngineConfig(max_batch=3)).engine.config.max_batch == 3


def test_a_second_server_with_other_settings_is_refused_while_the_first_runs(llm: quickdraft.LLM) -> None:
    """One model, one engine: a second server over the same LLM shares the first's engine when its
    settings agree, and is refused, naming the way out, when they differ (its port freed)."""
    first = BackgroundServer(llm, ServerConfig("tiny", engine=EngineConfig(max_batch=4, max_seq_len=256)))
    try:
        same = BackgroundServer(llm, ServerConfig("tiny", engine=EngineConfig(max_batch=4, max_seq_len=256)))
        assert same.worker.service is first.worker.service
        same.stop()
        with pytest.raises(QuickdraftError, match="already runs this model's engine"):
            BackgroundServer(llm, ServerConfig("tiny", engine=EngineConfig(max_batch=2, max_seq_len=256)))
    finally:
        first.stop()
    other = BackgroundServer(llm, ServerConfig("tiny", engine=EngineConfig(max_batch=2, max_seq_len=256)))
    try:
        assert other.worker.engine.config.max_batch == 2  # the first has stopped: the engine is set up anew
    finally:
        other.stop()
