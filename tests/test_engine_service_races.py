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
from typing import Callable, TypeVar

import httpx
import torch
import pytest

import quickdraft
from quickdraft import SamplingParams
from quickdraft.cache import KVCache
from quickdraft.engine import generate_tokens
from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.events import TokenEvent
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
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
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
                                SpecConfig())
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
    cache = llm.model.new_cache(1, 4)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    allocate, calls = torch.Tensor.new_zeros, []

    def fails_third(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", fails_third)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.reserve(2, 8)
    assert (cache.batch_size, cache.max_len) == (1, 4)
    assert all(torch.equal(t, b) for t, b in zip(cache.k + cache.v, before)), "some layers grew, others did not"
