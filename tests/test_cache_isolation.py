"""The prefix cache between clients of one server: each API key is a tenant whose requests find only
their own cached prefixes (issue 45). A client who guesses another's prompt learns nothing from
cached_tokens or from its time to first token, and one tenant's long prompts do not evict another's
prefixes. Real SmolLM2 (a tiny model's prefill is too quick for times to tell anything); slow.

Oracles: the same requests under one key (the shared scope), where the guess is found (cached_tokens
near the prompt's length, a shorter TTFT, the two-sample test rejecting) and the long prompt evicts:
the negative control of each check.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import time
from typing import Iterator

import httpx
import pytest

import quickdraft
from quickdraft.kv.prefix_cache import BLOCK
from support.server import NAME, Server

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
TRIALS = 20
ALPHA = 1e-3  # the two-sample test's false-alarm rate where the two samples have one law
WORDS = ("river stone cloud apple engine violet copper meadow signal lantern harbor falcon pepper marble "
         "orbit candle walnut glacier saddle thunder").split()


def secret(seed: int, words: int = 240) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test, normal approximation (fine at 20 + 20, no ties)."""
    ranked = sorted((v, i < len(x)) for i, v in enumerate(x + y))
    u = sum(rank for rank, (_, from_x) in enumerate(ranked, 1) if from_x) - len(x) * (len(x) + 1) / 2
    mean, sd = len(x) * len(y) / 2, math.sqrt(len(x) * len(y) * (len(x) + len(y) + 1) / 12)
    return math.erfc(abs(u - mean) / sd / math.sqrt(2))


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load(prefix_cache_mb=64)  # ~80 of SmolLM2's blocks: a 2,500-token prompt fills it


def ask(s: Server, key: str, prompt: str) -> tuple[int, float]:
    """(cached_tokens, seconds to the first token) of one streamed completion."""
    t0, first, cached = time.perf_counter(), None, None
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                if '"usage": {' in line or '"usage":{' in line:
                    cached = json.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached, first - t0


@pytest.fixture(scope="module")
def server(llm: quickdraft.LLM) -> Iterator[Server]:
    s = Server(llm, max_batch=2, api_keys=(KEY_A, KEY_B))
    yield s
    s.stop()


@pytest.mark.parametrize("guesser", [KEY_B, KEY_A])  # KEY_A: one tenant guessing itself, the negative control
def test_a_guess_at_another_tenant_s_prompt_looks_like_an_unseen_prompt(server: Server, guesser: str) -> None:
    salt = 1000 * (guesser == KEY_A)
    seen, unseen = [], []
    for i in range(TRIALS):  # interleaved: the machine's drift falls on both samples alike
        prompt = secret(salt + 2 * i)
        ask(server, KEY_A, prompt)                               # tenant A sends its secret
        seen.append(ask(server, guesser, prompt))                # the guess: A's prompt
        unseen.append(ask(server, guesser, secret(salt + 2 * i + 1)))  # a prompt nobody sent
    p = mann_whitney_p([t for _, t in seen], [t for _, t in unseen])
    if guesser == KEY_B:
        assert all(c < BLOCK for c, _ in seen + unseen), (seen, unseen)  # no block of A's prompt, nor of any
        assert p > ALPHA, (p, statistics.median(t for _, t in seen), statistics.median(t for _, t in unseen))
    else:
        assert min(c for c, _ in seen) > 200 and max(c for c, _ in unseen) < BLOCK
        assert p < ALPHA, p


@pytest.mark.parametrize("shared", [False, True])  # True: both under one key, the negative control
def test_a_long_prompt_of_one_tenant_leaves_another_s_prefixes(shared: bool) -> None:
    s = Server(quickdraft.load(prefix_cache_mb=32), max_batch=2, max_seq=4096, api_keys=(KEY_A, KEY_B))  # ~40 blocks
    try:
        prompt = secret(7, words=200)
        ask(s, KEY_A, prompt)
        ask(s, KEY_A if shared else KEY_B, secret(8, words=2500))  # ~2,500 tokens: four times the budget
        cached, _ = ask(s, KEY_A, prompt)
    finally:
        s.stop()
    assert (cached < 100) if shared else (cached > 180), cached
