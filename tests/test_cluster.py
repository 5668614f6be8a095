"""The cluster's parts that need no Ray: prefix digests against the prefix cache, the routing choice,
the front's relaying, retries and merged metrics (over fake replicas), the in-process ASGI call, and
the serve flags. tests/test_cluster_ray.py runs the whole on a local Ray cluster.
"""
from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from quickdraft.cli import main
from quickdraft.cluster.affinity import Candidate, PrefixMap, rank
from quickdraft.cluster.asgi import HttpCall, call_app
from quickdraft.cluster.digests import held_digests, prompt_digests
from quickdraft.cluster.ingress import REPLICA_HEADER, RETRIES, Ingress, ReplicaLost, merge_labelled
from quickdraft.cluster.load import ONE_PROCESS, ReplicaLoad, load_between, load_table, replica_loads
from quickdraft.cluster.placement import replica_threads
from quickdraft.errors import QuickdraftError
from quickdraft.kv.prefix_cache import BLOCK
from quickdraft.server import responses as out
from quickdraft.server.metrics import Metrics
from quickdraft.server.prompts import Prompts
from quickdraft.weights.tokenizers import load_hf_tokenizer
from support.models import tiny
from support.prefix import MODEL, prefix_for, random_cache, tokens
from support.routes import CONTEXT, FakeReplicas, ask, body, start
from tiny_tokenizer import save_tokenizer

# -- digests: the router's names for what a prefix cache holds -----------------------------------------

def test_a_prompts_digests_are_those_of_the_blocks_the_prefix_cache_holds() -> None:
    model = tiny(MODEL)
    cache = random_cache(model, 1, 64, seed=0)
    prefix = prefix_for(model)
    stored = tokens(1, 56)  # 3 whole blocks and 8 tokens
    prefix.store(stored, cache, 0, torch.randn(56, model.config.hidden_size))
    held = set(held_digests(prefix))
    assert len(held) == prefix.stats.blocks == 4  # 3 blocks and the tail of 8 (which no whole block names)
    assert set(prompt_digests(stored)) < held
    same_start = stored[:40] + tokens(2, 30)  # shares 2 whole blocks (32 tokens), then differs
    digests = prompt_digests(same_start)
    assert len(digests) == len(same_start) // BLOCK == 4
    assert [d in held for d in digests] == [True, True, False, False]
    # a block holding the same ids after another history is another prefix: another digest
    assert prompt_digests(tokens(3, 16) + stored[16:32])[1] != prompt_digests(stored)[1]
    assert held_digests(None) == []


# -- the routing choice --------------------------------------------------------------------------------

def test_the_longest_cached_prefix_wins_within_the_slack_of_the_shortest_queue() -> None:
    replicas = [Candidate("a", load=0, matched=0), Candidate("b", load=3, matched=5), Candidate("c", load=1, matched=2)]
    assert rank(replicas, slack=4) == [["b"], ["a"], ["c"]]  # b holds most and is within 4 of a's queue
    assert rank(replicas, slack=2)[0] == ["c"]               # b is too far behind: c, the best of a and c
    busy = [Candidate("a", load=0, matched=0), Candidate("b", load=9, matched=50)]
    assert rank(busy, slack=4)[0] == ["a"]                   # one hot prefix cannot pile everything on b
    same = [Candidate("a", load=1, matched=3), Candidate("b", load=0, matched=3)]
    assert rank(same, slack=4)[0] == ["b"]                   # equal prefixes: the shorter queue
    shared = [Candidate("a", load=1, matched=2), Candidate("b", load=0, matched=0)]
    assert rank(shared, blocks=10)[0] == ["b"]  # 2 of 10 blocks (a system prompt): the idle replica
    assert rank(shared, blocks=4)[0] == ["a"]   # 2 of 4: half the prompt is there
    short = [Candidate("a", load=1, matched=1), Candidate("b", load=0, matched=0)]
    assert rank(short, blocks=3)[0] == ["b"]    # a 3-block first prompt behind another's 1-block system prompt
    turn2 = [Candidate("a", load=1, matched=3, continues=True), Candidate("b", load=0, matched=0)]
    assert rank(turn2, blocks=14)[0] == ["a"]   # 3 of 14 blocks, but all of its last turn's prompt: its history


def test_a_conversations_next_turn_continues_the_prompt_routed_before() -> None:
    """A next turn begins with every block of the last turn's prompt (then its answer, not yet
    advertised); another conversation behind the same system prompt does not. Minutes later, it
    still continues where the replica says it holds those blocks, and not where it evicted them."""
    known = PrefixMap(horizon_s=10.0)
    system, first = [7], [7, 21, 22]            # digests of block-aligned prefixes
    known.routed("a", first, now=100.0)
    turn2 = first + [23, 24, 25]                # history, answer, question

    def continues(replica: str, digests: list[int], now: float) -> bool:
        return known.continued(replica, digests[:known.matched(replica, digests, now=now)])

    assert continues("a", turn2, now=105.0)
    assert not continues("b", turn2, now=105.0)               # routed elsewhere
    assert not continues("a", system + [31, 32], now=105.0)   # another session: its system prompt only
    assert not continues("a", turn2, now=300.0)               # later: the replica has not said it holds them
    known.advertise("a", [7, 21, 22, 23])
    assert continues("a", turn2, now=300.0)                   # it says so: still the conversation's replica
    known.advertise("a", [7, 21])                             # evicted
    assert not continues("a", turn2, now=300.0)
    known.forget("a")
    known.advertise("a", [7, 21, 22, 23])                     # a successor holding those blocks from elsewhere
    assert not continues("a", turn2, now=300.0)


def test_idle_replicas_with_nothing_cached_take_turns() -> None:
    idle = [Candidate("a", 0, 0), Candidate("b", 0, 0), Candidate("c", 0, 0)]
    assert [rank(idle, turn=t)[0][0] for t in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_what_a_replica_holds_is_its_word_or_a_recent_route() -> None:
    known = PrefixMap(horizon_s=10.0)
    prompt = [11, 12, 13, 14]
    known.advertise("a", [11, 12])
    assert known.matched("a", prompt, now=0.0) == 2 and known.matched("b", prompt, now=0.0) == 0
    known.routed("b", prompt, now=100.0)
    assert known.matched("b", prompt, now=105.0) == 4      # just routed there: its prefill stores it
    assert known.matched("b", prompt, now=111.0) == 0      # past the horizon only its own word counts
    known.advertise("b", [11, 12, 13])
    assert known.matched("b", prompt, now=111.0) == 3
    known.advertise("a", [])                               # evicted, as it says
    assert known.matched("a", prompt, now=0.0) == 0
    known.forget("b")                                      # died: its successor starts empty
    assert known.matched("b", prompt, now=111.0) == 0 and known.replicas() == {"a"}


# -- the front: relaying, retries, /health and /metrics over fake replicas -----------------------------

def tiny_prompts(tmp_path: Path) -> Prompts:
    return Prompts(load_hf_tokenizer(save_tokenizer(tmp_path / "tok")))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "a question long enough to fill two blocks of ids"}]}


def test_the_front_relays_the_replicas_answer_and_routes_by_the_prompts_digests(tmp_path: Path) -> None:
    prompts = tiny_prompts(tmp_path)
    replicas = FakeReplicas([[start(), body(b'{"answer": ', more=True), body(b"1}")]])
    ingress = Ingress(replicas, prompts, 1 << 20, CONTEXT)
    response = ask(ingress, "POST", "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.json() == {"answer": 1}
    assert response.headers[REPLICA_HEADER] == "r1"
    call, digests = replicas.calls[0]
    assert (call.method, call.path, json.loads(call.body)) == ("POST", "/v1/chat/completions", CHAT)
    ids = prompts.tokenizer.encode(prompts.tokenizer.chat_text(CHAT["messages"]), add_special_tokens=False)
    assert len(ids) >= 2 * BLOCK and digests == prompt_digests(ids)  # tokenized as the replica's app does
    completion = FakeReplicas([[start(), body(b"{}")]] * 2)
    ask(Ingress(completion, prompts, 1 << 20, CONTEXT), "POST", "/v1/completions", {"model": "m", "prompt": list(range(40))})
    assert completion.calls[0][1] == prompt_digests(list(range(40)))
    refused = FakeReplicas([[start(400), body(b"{}")]])  # not a valid request: routed by load, the replica says why
    ask(Ingress(refused, prompts, 1 << 20, CONTEXT), "POST", "/v1/chat/completions", {"model": "m", "messages": "no"})
    assert refused.calls[0][1] == []


def test_a_request_whose_replica_is_lost_before_answering_goes_to_another(tmp_path: Path) -> None:
    replicas = FakeReplicas([[ReplicaLost("killed")], [start(replica="r2"), body(b"{}")]])
    ingress = Ingress(replicas, tiny_prompts(tmp_path), 1 << 20, CONTEXT)
    response = ask(ingress, "POST", "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r2"
    assert len(replicas.calls) == 2 and replicas.calls[0] == replicas.calls[1]  # the same request, again
    # lost after its head (a non-streamed answer's head and body come together): still nothing was sent
    late = FakeReplicas([[start(), ReplicaLost("killed")], [start(replica="r2"), body(b"{}")]])
    assert ask(Ingress(late, tiny_prompts(tmp_path), 1 << 20, CONTEXT), "POST", "/v1/chat/completions", CHAT).status_code == 200
    metrics = ask(ingress, "GET", "/metrics").text
    assert 'quickdraft_cluster_lost_requests_total{outcome="retried"} 1.0' in metrics
    assert 'quickdraft_cluster_routed_requests_total{replica="r2"} 1.0' in metrics


def test_a_stream_whose_replica_is_lost_ends_with_an_error_event_and_done(tmp_path: Path) -> None:
    first = b'data: {"choices": [{"text": "Hel"}]}\n\n'
    replicas = FakeReplicas([[start(sse=True), body(first, more=True), ReplicaLost("killed")]])
    response = ask(Ingress(replicas, tiny_prompts(tmp_path), 1 << 20, CONTEXT), "POST", "/v1/completions",
                   {"model": "m", "prompt": "hi", "stream": True})
    assert response.status_code == 200 and len(replicas.calls) == 1  # begun: not sent again
    events = response.text.split("\n\n")
    assert events[0] + "\n\n" == first.decode()
    assert json.loads(events[1].removeprefix("data: "))["error"]["message"].startswith("the replica running")
    assert response.text.endswith(out.SSE_DONE)


def test_a_request_no_replica_could_take_is_a_503_with_retry_after(tmp_path: Path) -> None:
    replicas = FakeReplicas([[ReplicaLost("killed")]] * (RETRIES + 1))
    response = ask(Ingress(replicas, tiny_prompts(tmp_path), 1 << 20, CONTEXT), "POST", "/v1/chat/completions", CHAT)
    assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
    assert response.json()["error"]["code"] == "replica_unavailable"


def test_a_body_over_the_limit_is_a_413_from_the_front(tmp_path: Path) -> None:
    replicas = FakeReplicas([])
    response = ask(Ingress(replicas, tiny_prompts(tmp_path), 100, CONTEXT), "POST", "/v1/completions", content=b"x" * 101)
    assert response.status_code == 413 and "100 bytes" in response.json()["error"]["message"]
    assert replicas.calls == []


def test_health_counts_the_replicas_that_answer(tmp_path: Path) -> None:
    report = {"replica": "r1", "metrics": b"", "runtime": {"kernel": "avx2"}}
    for reports, code, status in (([report, {**report, "replica": "r2"}], 200, "ok"), ([report], 200, "degraded"),
                                  ([], 503, "unavailable")):
        response = ask(Ingress(FakeReplicas([], reports), tiny_prompts(tmp_path), 1 << 20, CONTEXT), "GET", "/health")
        assert response.status_code == code and response.json()["status"] == status
        assert response.json()["replicas"] == {"healthy": len(reports), "wanted": 2}


def test_metrics_of_every_replica_come_labelled_with_it() -> None:
    replicas = {"r1": Metrics(), "r2": Metrics()}
    replicas["r1"].finish("a", "stop")
    for request in "bcd":
        replicas["r2"].finish(request, "length")
    merged = merge_labelled([(name, m.render().decode()) for name, m in replicas.items()]).decode()
    assert 'quickdraft_requests_total{finish_reason="stop",replica="r1"} 1.0' in merged
    assert 'quickdraft_requests_total{finish_reason="length",replica="r2"} 3.0' in merged
    assert 'quickdraft_prompt_tokens_total{replica="r2"} 0.0' in merged
    assert merged.count("# TYPE quickdraft_requests_total counter") == 1  # one family, samples of both
    parsed = {f.name: f for f in text_string_to_metric_families(merged)}
    assert {s.labels["replica"] for s in parsed["quickdraft_requests"].samples} == {"r1", "r2"}


def test_each_replicas_load_is_read_back_from_the_merged_metrics(tmp_path: Path) -> None:
    """What bench serve/multiturn report per replica: the front's /metrics over real Metrics, with its
    routed counter, read back, and the difference of two readings (a replica new since the first
    counts from zero)."""
    replicas = {"r1": Metrics(), "r2": Metrics()}
    replicas["r1"].finish("a", "stop")
    replicas["r1"].prompt_tokens.inc(30)
    replicas["r1"].cached_tokens.inc(90)
    replicas["r1"].generated.inc(7)
    for request in "bc":
        replicas["r2"].finish(request, "length")
    replicas["r2"].prompt_tokens.inc(50)
    ingress = Ingress(FakeReplicas([], []), tiny_prompts(tmp_path), 1 << 20, CONTEXT)
    ingress.routed.labels(replica="r1").inc()
    ingress.routed.labels(replica="r2").inc(3)

    def text() -> str:  # the front's /metrics over the replicas' reports now
        ingress.replicas._reports = [{"replica": n, "metrics": m.render(), "runtime": {}} for n, m in replicas.items()]
        return ask(ingress, "GET", "/metrics").text

    first = replica_loads(text())
    assert first == {"r1": ReplicaLoad(routed=1, requests=1, prefilled_tokens=30, cached_tokens=90, generated_tokens=7),
                     "r2": ReplicaLoad(routed=3, requests=2, prefilled_tokens=50)}
    assert first["r1"].cached_fraction == 0.75 and first["r2"].cached_fraction == 0.0
    replicas["r2"].finish("d", "stop")
    replicas["r3"] = Metrics()
    replicas["r3"].finish("e", "stop")
    later = load_between(first, replica_loads(text()))
    assert later["r1"] == ReplicaLoad() and later["r2"] == ReplicaLoad(requests=1)
    assert later["r3"] == ReplicaLoad(requests=1) and later["r3"].cached_fraction is None
    one = Metrics()
    one.finish("x", "stop")
    assert replica_loads(one.render().decode()) == {ONE_PROCESS: ReplicaLoad(requests=1)}
    table = load_table({n: lo.as_dict() for n, lo in first.items()})
    assert "| r1 | 1 | 1 | 120 | 90 | 75.0% | 7 |" in table and "| r2 | 3 | 2 | 50 | 0 | 0.0% | 0 |" in table


def test_replicas_without_a_prefix_cache_are_routed_by_queue_alone() -> None:
    """Under --no-prefix-cache the router gets no digests: it would count a prompt routed to a replica
    as cached there and send every prompt starting alike (one chat template) to that replica."""
    pytest.importorskip("ray")
    from quickdraft.cluster.launch import RayReplicas
    sent: list[list[int]] = []

    class Answer:
        def __aiter__(self) -> Answer:
            return self

        async def __anext__(self) -> dict[str, Any]:
            raise StopAsyncIteration

    class Handle:
        def options(self, stream: bool) -> Handle:
            return self

        @property
        def forward(self) -> Handle:
            return self

        def remote(self, call: HttpCall, digests: list[int]) -> Answer:
            sent.append(digests)
            return Answer()

    call = HttpCall("POST", "/v1/completions", b"", (), b"{}")

    async def relay(replicas: RayReplicas) -> None:
        async for _ in replicas.stream(call, [1, 2, 3]):
            pass

    asyncio.run(relay(RayReplicas(Handle(), 2)))
    asyncio.run(relay(RayReplicas(Handle(), 2, cached=False)))
    assert sent == [[1, 2, 3], []]


def test_a_request_keeps_its_turn_however_often_ray_asks_to_rank_for_it() -> None:
    """Ray asks the router again for a request the first-ranked replica could not take; round robin
    counted a turn per question and sent runs of requests to one replica on a loaded machine."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from quickdraft.cluster.router import Turns
    request = lambda rid: SimpleNamespace(metadata=SimpleNamespace(request_id=rid))
    turns = Turns(remembered=2)
    a, b = request("a"), request("b")
    assert [turns.of(a), turns.of(a), turns.of(b), turns.of(a), turns.of(b)] == [1, 1, 2, 1, 2]
    assert turns.of(None) == 3 and turns.of(None) == 4      # a ranking for no request: a turn each
    assert turns.of(request("c")) == 5 and turns.of(a) == 6  # only the last `remembered` kept


# -- the replica's side: a request through an app in process --------------------------------------------

def test_an_app_answers_in_process_and_hears_its_client_leave() -> None:
    left = asyncio.Event()

    async def tokens(request: Any) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                left.set()
        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", tokens, methods=["POST"])])
    call = HttpCall("POST", "/s", b"", ((b"host", b"127.0.0.1"),), b"{}")

    async def go() -> list[dict[str, Any]]:
        got = []
        async for message in call_app(app, call):
            got.append(message)
            if len(got) == 3:
                break  # the client leaves
        await asyncio.wait_for(left.wait(), 5)  # the app's stream was closed
        return got

    got = asyncio.run(go())
    assert got[0]["type"] == "http.response.start" and got[0]["status"] == 200
    assert [m["body"] for m in got[1:]] == [b"data: 0\n\n", b"data: 1\n\n"]


# -- CPUs: a replica's threads on one node ---------------------------------------------------------------

@pytest.mark.parametrize("node_cpus, replicas, threads, expected", [
    ([1, 1], 2, 1, 1),        # one replica on each node
    ([1, 1], 2, None, 1),
    ([4, 4], 2, None, 4),     # the cluster's CPUs shared out
    ([4, 2], 2, None, 2),     # 3 each would fit 2 CPUs' total + 4 but not the node of 2
    ([8], 3, None, 2),
    ([4, 2], 3, 2, 2),        # two on the first node, one on the second
])
def test_replica_threads_fit_node_by_node(node_cpus: list[int], replicas: int, threads: int | None,
                                          expected: int) -> None:
    assert replica_threads(node_cpus, replicas, threads) == expected


@pytest.mark.parametrize("node_cpus, replicas, threads", [
    ([1, 1], 1, 2),   # 2 CPUs in all, but no node has 2: Ray would leave the replica pending for ever
    ([3, 3], 3, 2),   # 6 CPUs for 3 x 2, one replica a node
    ([1], 2, None),   # fewer CPUs than replicas
    ([], 1, None),    # no node with a CPU
])
def test_replicas_that_no_nodes_hold_are_an_error_naming_the_nodes(node_cpus: list[int], replicas: int,
                                                                   threads: int | None) -> None:
    with pytest.raises(QuickdraftError) as error:
        replica_threads(node_cpus, replicas, threads)
    assert f"--replicas {replicas} x" in str(error.value)
    assert f"nodes have {sorted(node_cpus, reverse=True)} CPUs" in str(error.value)


# -- the flags --------------------------------------------------------------------------------------------

def test_replicas_without_the_cluster_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert main(["serve", "-m", "no-such-model", "--replicas", "2", "--port", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("pip install 'quickdraft[cluster]'"), err
    assert "--replicas 2" in err[0]
    assert main(["serve", "-m", "no-such-model", "--replicas", "0"]) == 1
    assert "--replicas and --threads must be >= 1" in capsys.readouterr().err
