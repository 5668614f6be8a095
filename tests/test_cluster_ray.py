"""`quickdraft serve --replicas 2` on a local Ray cluster: 2 replicas x 1 thread of the real SmolLM2
behind the front, as served (one module-scoped cluster: Ray and two model loads take a while).

Oracles: one process's greedy answers (the same model loaded here), the replica each answer names
and the cached tokens it reports, and a replica's process killed mid-request.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from quickdraft.api import load
from quickdraft.cluster.ingress import REPLICA_HEADER
from quickdraft.engine.batch import EngineConfig
from quickdraft.prefix_cache import BLOCK
from quickdraft.proposers import SpecConfig
from quickdraft.sampling import SamplingParams
from quickdraft.server import ServerConfig, listen

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TOKENS = 24
RETRIED = 400  # tokens of the request that is on the replica killed: still running when it dies


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    from quickdraft.cluster.launch import ClusterPlan, running
    from quickdraft.cluster.replica import ReplicaSetup
    config = ServerConfig("smollm2", engine=EngineConfig(max_batch=4, max_seq_len=2048))
    setup = ReplicaSetup(config, {"model": MODEL}, measure_cost=False)
    with running(setup, ClusterPlan(replicas=2, threads=1), MODEL, listen("127.0.0.1", 0)) as front:
        yield front.url


@pytest.fixture(scope="module")
def one_process():
    return load(MODEL, spec=SpecConfig(method="none"))


def chat(url: str, messages: list[dict[str, str]], stream: bool = False, tokens: int = TOKENS,
         **fields) -> httpx.Response:
    body = {"model": "smollm2", "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": stream,
            **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Write a haiku about rain.",
             "How do airplanes fly?", "Explain recursion briefly.", "What is 12 times 13?",
             "Give a synonym for quick.", "Why is the sky blue?"]


def test_every_greedy_answer_is_one_processes(cluster: str, one_process) -> None:
    answers: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        answers[i] = chat(cluster, [{"role": "user", "content": QUESTIONS[i]}], stream=i % 2 == 1)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served_by = set()
    for i, question in enumerate(QUESTIONS):
        response = answers[i]
        assert response.status_code == 200, response.text
        served_by.add(response.headers[REPLICA_HEADER])
        if i % 2:
            events = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        else:
            text = response.json()["choices"][0]["message"]["content"]
        alone = one_process.generate(messages=[{"role": "user", "content": question}],
                                     params=SamplingParams(temperature=0.0, max_new_tokens=TOKENS))
        assert text == alone.text, (question, text, alone.text)
    assert len(served_by) == 2  # 8 at once: both replicas answered


def test_a_conversation_returns_to_the_replica_holding_its_history(cluster: str) -> None:
    sessions = [[{"role": "system", "content": f"You are assistant number {s}, brief and kind."}] for s in range(2)]
    replicas: list[set[str]] = [set(), set()]
    previous = [0, 0]  # each session's last prompt, in tokens
    for turn in range(4):
        for s, history in enumerate(sessions):
            history.append({"role": "user", "content": f"Turn {turn}: {QUESTIONS[turn + 2 * s]}"})
            response = chat(cluster, history)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            replicas[s].add(response.headers[REPLICA_HEADER])
            if turn:  # everything up to the last whole block of the previous prompt is cached, at least
                assert usage["prompt_tokens_details"]["cached_tokens"] >= previous[s] // BLOCK * BLOCK, (turn, usage)
            previous[s] = usage["prompt_tokens"]
            history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    assert all(len(r) == 1 for r in replicas), replicas  # each session stayed on one replica


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def test_a_killed_replica_ends_its_requests_cleanly_and_comes_back(cluster: str) -> None:
    before = health(cluster)
    assert before["status"] == "ok" and before["replicas"] == {"healthy": 2, "wanted": 2}
    prompt = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", timeout=300,
                      json={"model": "smollm2", "messages": prompt, "max_tokens": 1500, "temperature": 0,
                            "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it has begun
        victim = stream.headers[REPLICA_HEADER]
        # the same prompt, not streamed: routed to the replica holding it, it has sent nothing when that dies
        retried: dict[str, httpx.Response] = {}
        waiting = threading.Thread(target=lambda: retried.update(r=chat(cluster, prompt, tokens=RETRIED)))
        waiting.start()
        time.sleep(1.0)
        os.kill(before["runtime"][victim]["pid"], signal.SIGKILL)
        rest = [line for line in lines if line]
    errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and rest[-1] == "data: [DONE]", rest[-3:]
    assert health(cluster)["status"] == "degraded"  # a new replica takes seconds to load its model
    waiting.join()
    answer = retried["r"]
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] != victim
    survivor = next(iter(set(before["runtime"]) - {victim}))
    assert answer.headers[REPLICA_HEADER] == survivor
    deadline = time.monotonic() + 60
    while (now := health(cluster))["status"] != "ok":
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert victim not in now["runtime"] and survivor in now["runtime"]
    again = chat(cluster, prompt, tokens=RETRIED)  # greedy: the retried answer is the answer
    assert again.json()["choices"][0]["message"] == answer.json()["choices"][0]["message"]
