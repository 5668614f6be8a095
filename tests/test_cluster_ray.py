"""`quickdraft serve --replicas 2` on a local Ray cluster: 2 replicas x 1 thread of the real SmolLM2
behind the front, as served (one module-scoped cluster: Ray and two model loads take a while), and
`--ray-address` joining a cluster of two Ray nodes started by the test.

Oracles: one process's greedy answers (the same model loaded here), the replica each answer names
and the cached tokens it reports, and a replica's process killed mid-request.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quickdraft.api import load
from quickdraft.cluster.ingress import REPLICA_HEADER
from quickdraft.cluster.load import ReplicaLoad, replica_loads
from quickdraft.engine.batch import EngineConfig
from quickdraft.kv.prefix_cache import BLOCK
from quickdraft.proposers import SpecConfig
from quickdraft.server import ServerConfig, listen
from quickdraft.spec.sampling import SamplingParams
from support.replicas import MODEL, free_port, serve_replicas, stop

pytestmark = pytest.mark.slow
TOKENS = 24
RETRIED = 400  # tokens of the request that is on the replica killed: still running when it dies


# -- SIGTERM: `quickdraft serve --replicas 2` as run, a process of its own (first: no other cluster runs yet) ----

SHUTDOWN_S = 15.0  # --shutdown-timeout: the short chats finish within it (loaded too), the long ones do not
EXIT_BOUND_S = 60.0  # from SIGTERM to the process gone, Ray's processes with it
SHORT = 24  # tokens of the chats that finish within --shutdown-timeout


def stream_lines(url: str, route: str, fields: dict, began: threading.Event, out: dict) -> None:
    """A streamed request; `out` gets its status, the replica that answers and every line, or the exception."""
    try:
        with httpx.stream("POST", f"{url}/v1/{route}", timeout=120, json={
                "model": "smollm2", "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **fields}) as r:
            out["status"], out["replica"], out["lines"] = r.status_code, r.headers.get(REPLICA_HEADER), []
            for line in r.iter_lines():
                if line:
                    out["lines"].append(line)
                    began.set()
    except Exception as e:
        out["error"] = e
    finally:
        began.set()


def counting(i: int) -> dict:
    """A completion that runs past --shutdown-timeout: greedy SmolLM2 goes on counting."""
    return {"prompt": ", ".join(str(n) for n in range(i, i + 20)) + ",", "max_tokens": 3900}


def question(i: int) -> dict:
    return {"messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": SHORT}


def test_sigterm_drains_every_replica() -> None:
    """Streams in flight on both replicas when SIGTERM comes: the short ones finish (a finish reason,
    usage, [DONE]), the long ones end at --shutdown-timeout with an error event and [DONE], none cut
    off; a request after the signal is refused (no listener, or a 503), never half-answered; the
    process exits 0 within EXIT_BOUND_S and leaves none of Ray's processes behind."""
    psutil = pytest.importorskip("psutil")
    # round robin: prompts of one chat template would all go to the replica holding its system prompt
    proc, url = serve_replicas("--shutdown-timeout", str(SHUTDOWN_S), "--router", "round-robin")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        # two long completions, one on each replica, then two short chats
        streams = [("completions", counting(1)), ("completions", counting(100)),
                   ("chat/completions", question(0)), ("chat/completions", question(1))]
        outs: list[dict] = [{} for _ in streams]
        threads = []
        for (route, fields), out in zip(streams, outs):
            began = threading.Event()
            threads.append(threading.Thread(target=stream_lines, args=(url, route, fields, began, out)))
            threads[-1].start()
            assert began.wait(120) and "error" not in out, out
        assert outs[0]["replica"] != outs[1]["replica"]  # a long stream in flight on each replica
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        try:
            late = chat(url, [{"role": "user", "content": "Are you there?"}])
            assert late.status_code == 503 and late.headers.get("Retry-After"), late.text
        except httpx.TransportError:
            pass  # the front no longer listens
        for t in threads:
            t.join(60)
        for (route, fields), o in zip(streams, outs):
            lines = o["lines"]
            assert "error" not in o and o["status"] == 200 and lines[-1] == "data: [DONE]", (fields, o)
            events = [json.loads(line[6:]) for line in lines[:-1]]
            if route == "chat/completions":  # finished within the timeout
                assert events[-1]["usage"]["completion_tokens"] <= SHORT, events[-1]
                assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length"), events[-2:]
            else:  # cut at the timeout, with a last word
                assert "shutting down" in events[-1].get("error", {}).get("message", ""), events[-3:]
        assert proc.wait(EXIT_BOUND_S - (time.monotonic() - signalled)) == 0
        output = proc.stdout.read().decode()
        assert "Traceback" not in output, output
        alive = psutil.wait_procs(children, timeout=10)[1]
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        stop(proc)


# -- `--ray-address`: a cluster of two Ray nodes, started here, joined by `quickdraft serve` ----------------

@pytest.fixture
def two_nodes() -> Iterator[str]:
    """A Ray cluster of two nodes (two raylets on this machine, as Ray's own multi-node tests run),
    1 CPU each, so that 2 replicas x 1 thread need both; its address."""
    from ray.cluster_utils import Cluster
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        yield nodes.address
        assert nodes.remaining_processes_alive()  # quickdraft left the cluster it joined running
    finally:
        nodes.shutdown()


def alive_nodes_and_free_cpus(address: str) -> tuple[int, float]:
    import ray
    ray.init(address=address, logging_level="warning", log_to_driver=False)
    try:
        return sum(n["Alive"] for n in ray.nodes()), ray.available_resources().get("CPU", 0.0)
    finally:
        ray.shutdown()


def test_replicas_join_a_cluster_of_two_nodes_by_address(two_nodes: str, one_process) -> None:
    """`--ray-address` of a cluster quickdraft did not start: one replica on each node, both answering
    one process's greedy texts, a conversation's second turn cached; SIGTERM ends quickdraft with exit
    0, the cluster still running with both nodes and their CPUs free again."""
    proc, url = serve_replicas("--ray-address", two_nodes)
    try:
        runtime = health(url)["runtime"]
        assert len({r["node_id"] for r in runtime.values()}) == 2, runtime
        assert greedy_answers(url, one_process) == set(runtime)
        assert all(len(r) == 1 for r in converse(url, sessions=1, turns=2))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_BOUND_S) == 0
        output = proc.stdout.read().decode()
        assert "Traceback" not in output, output
    finally:
        stop(proc)
    deadline = time.monotonic() + 30  # the replicas' CPUs are given back as Ray stops their actors
    while (now := alive_nodes_and_free_cpus(two_nodes)) != (2, 2.0):
        assert time.monotonic() < deadline, now
        time.sleep(1.0)


UNREACHED_BOUND_S = 60.0  # starting Python, torch and Ray on a loaded machine, and the connection refused


def test_an_address_no_cluster_answers_is_one_line_within_a_bound() -> None:
    """Ray's client would retry it for ever, a warning every few seconds."""
    done = subprocess.run([sys.executable, "-m", "quickdraft", "serve", "--model", MODEL, "--replicas", "2",
                           "--port", str(free_port()), "--ray-address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=UNREACHED_BOUND_S)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 2, done.stderr  # the start's line, then the error's
    assert lines[1].startswith("quickdraft: error: --ray-address 127.0.0.1:1: no Ray cluster answers there"), lines


# -- one cluster in this process, for the rest ------------------------------------------------------------

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


def greedy_answers(url: str, one_process) -> set[str]:
    """The QUESTIONS at once, half streamed: every text is one process's; the replicas that answered."""
    answers: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        answers[i] = chat(url, [{"role": "user", "content": QUESTIONS[i]}], stream=i % 2 == 1)

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
    return served_by


def test_every_greedy_answer_is_one_processes(cluster: str, one_process) -> None:
    assert len(greedy_answers(cluster, one_process)) == 2  # 8 at once: both replicas answered


def converse(url: str, sessions: int, turns: int) -> list[set[str]]:
    """Conversations taking turns: every turn after the first finds at least the previous prompt's
    whole blocks cached; the replicas each conversation went to."""
    histories = [[{"role": "system", "content": f"You are assistant number {s}, brief and kind."}]
                 for s in range(sessions)]
    replicas: list[set[str]] = [set() for _ in histories]
    previous = [0 for _ in histories]  # each session's last prompt, in tokens
    for turn in range(turns):
        for s, history in enumerate(histories):
            history.append({"role": "user", "content": f"Turn {turn}: {QUESTIONS[turn + 2 * s]}"})
            response = chat(url, history)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            replicas[s].add(response.headers[REPLICA_HEADER])
            if turn:
                assert usage["prompt_tokens_details"]["cached_tokens"] >= previous[s] // BLOCK * BLOCK > 0, (turn, usage)
            previous[s] = usage["prompt_tokens"]
            history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return replicas


def test_a_conversation_returns_to_the_replica_holding_its_history(cluster: str) -> None:
    assert all(len(r) == 1 for r in converse(cluster, sessions=2, turns=4))  # each session stayed on one replica


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def lost(url: str) -> float:
    """Requests whose replica was lost while it answered, as the front counts them."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "quickdraft_cluster_lost_requests_total")


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


def test_a_replica_killed_under_load_costs_no_5xx_beyond_its_requests_and_health_stays_honest(cluster: str) -> None:
    """Clients keep 4 requests in flight (streamed and not) over both replicas while one replica's
    process is killed: every answer is a 200 or, at most one per client in flight, a 503 with
    Retry-After; a stream cut there ends with an error event and [DONE]; /health, polled throughout,
    never names the dead replica once it is gone nor says ok before a new one answers, and is ok
    again within 60 s."""
    wait_for_ok = time.monotonic() + 60
    while health(cluster)["status"] != "ok":  # the test before restarted a replica
        assert time.monotonic() < wait_for_ok
        time.sleep(0.5)
    before = health(cluster)
    statuses: list[int] = []
    cut_streams: list[list[str]] = []
    healths: list[tuple[float, dict]] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            messages = [{"role": "user", "content": f"{QUESTIONS[i]} Answer {len(statuses)}."}]
            if i % 2:
                response = chat(cluster, messages, tokens=48)
            else:
                with httpx.stream("POST", f"{cluster}/v1/chat/completions", timeout=300, json={
                        "model": "smollm2", "messages": messages, "max_tokens": 48, "temperature": 0,
                        "stream": True}) as response:
                    lines = [line for line in response.iter_lines() if line]
                if response.status_code == 200:
                    assert lines[-1] == "data: [DONE]", lines[-3:]
                    if any('"error"' in line for line in lines):
                        cut_streams.append(lines)
            statuses.append(response.status_code)
            if response.status_code != 200:
                assert response.status_code == 503 and response.headers.get("Retry-After"), response.text

    def poll() -> None:
        while not stop.is_set():
            healths.append((time.monotonic(), health(cluster)))
            time.sleep(0.3)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(4)] + [threading.Thread(target=poll)]
    for w in workers:
        w.start()
    time.sleep(3.0)
    # the replica taking most of the load (one chat template's prefix draws it there) dies
    routed = replica_loads(httpx.get(f"{cluster}/metrics", timeout=30).text)
    victim = max(before["runtime"], key=lambda name: routed.get(name, ReplicaLoad()).routed)
    survivor = next(iter(set(before["runtime"]) - {victim}))
    lost_before = lost(cluster)
    killed = time.monotonic()
    os.kill(before["runtime"][victim]["pid"], signal.SIGKILL)
    back = None
    while back is None and time.monotonic() - killed < 60:
        time.sleep(0.5)
        back = next((t for t, h in healths if t > killed + 1 and h["status"] == "ok"), None)
    time.sleep(2.0)  # load on the restarted pair too
    stop.set()
    for w in workers:
        w.join(300)
    assert back is not None and back - killed < 60, healths[-1]
    errors = [s for s in statuses if s != 200]
    assert len(errors) + len(cut_streams) <= 4, (errors, len(cut_streams))  # at most what was in flight on it
    assert len(statuses) > 8  # the load went on while the replica was gone
    assert lost(cluster) > lost_before  # requests were in flight on the victim (retried or ended there)
    for t, h in healths:
        assert h["status"] in ("ok", "degraded"), h  # the survivor answered throughout
        assert survivor in h["runtime"] and h["replicas"]["healthy"] == len(h["runtime"]), h
        if t > killed + 1:  # Ray's health check has had its chance to notice
            assert victim not in h["runtime"], h
    assert any(h["status"] == "degraded" for t, h in healths if t > killed)
