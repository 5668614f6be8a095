"""`quickdraft bench multiturn`: the sessions it builds from conversations, the history each turn
resends (the server's own answers), the report's arithmetic on made-up records, the servers' command
lines, llama-server's build prerequisites and AMX guard, and one real run against `quickdraft serve`
(slow: it loads SmolLM2-135M)."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from quickdraft.bench import llama_server, multiturn
from quickdraft.bench.amx_guard import has_amx
from quickdraft.bench.multiturn import SessionPlan, history, plan_sessions, run_sessions, shared_system_prompt, truncate
from quickdraft.bench.multiturn_report import (
    build_results,
    first_turns,
    markdown_report,
    per_turn,
    summarize,
    write_outputs,
)
from quickdraft.bench.multiturn_targets import (
    ServerSettings,
    Target,
    llama_server_command,
    measure_rounds,
    parse_targets,
    quickdraft_command,
)
from quickdraft.errors import QuickdraftError
from quickdraft.train.data import user_turns, without_benchmark


def _conversation(n_users: int, tag: str, system: bool = False) -> list[dict]:
    messages = [{"role": "system", "content": f"sys {tag}"}] if system else []
    for i in range(n_users):
        messages += [{"role": "user", "content": f"{tag} question {i + 1}"},
                     {"role": "assistant", "content": f"{tag} answer {i + 1}"}]
    return messages


def test_sessions_take_conversations_with_enough_turns_and_no_benchmark_question() -> None:
    conversations = [_conversation(2, "short"), _conversation(3, "a"), _conversation(5, "bench"),
                     _conversation(4, "b", system=True), _conversation(3, "c"), _conversation(1, "d")]
    banned = {"bench question 3"}  # one of its messages is a benchmark question: the whole conversation goes
    plans, spare = plan_sessions(without_benchmark(conversations, banned), sessions=2, turns=3, max_chars=100)
    assert [p.user_turns for p in plans] == [("a question 1", "a question 2", "a question 3"),
                                             ("b question 1", "b question 2", "b question 3")]
    # the spare text (a shared system prompt's) comes from the conversations after the sessions only
    assert spare == ["c answer 1", "c answer 2", "c answer 3", "d answer 1"]
    assert [turns[0] for turns in user_turns(conversations, 4)] == ["bench question 1", "b question 1"]


def test_user_turns_are_cut_at_a_word_boundary() -> None:
    assert truncate("short", 10) == "short"
    assert truncate("alpha beta gamma delta", 13) == "alpha beta"   # not "alpha beta ga"
    assert truncate("x" * 30, 10) == "x" * 10                        # no space: cut where the limit is
    plans, _ = plan_sessions([[{"role": "user", "content": "word " * 100}]], 1, 1, max_chars=42)
    assert len(plans[0].user_turns[0]) <= 42 and plans[0].user_turns[0].endswith("word")


def test_each_turn_resends_the_history_with_the_servers_answers() -> None:
    plan = SessionPlan(("u1", "u2", "u3"), system="shared")
    assert history(plan, [], 1) == [{"role": "system", "content": "shared"}, {"role": "user", "content": "u1"}]
    assert history(plan, ["a1", "a2"], 3) == [
        {"role": "system", "content": "shared"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
    assert history(SessionPlan(("u1",)), [], 1) == [{"role": "user", "content": "u1"}]


def test_the_shared_system_prompt_is_the_most_words_within_n_tokens() -> None:
    count = lambda text: len(text.split())
    texts = [" ".join(f"w{i}" for i in range(50)), " ".join(f"v{i}" for i in range(50))]
    prompt = shared_system_prompt(texts, 40, count)
    assert prompt.startswith(multiturn.SYSTEM_PREAMBLE.split()[0]) and count(prompt) == 40
    with pytest.raises(ValueError, match="fewer than 500 tokens"):
        shared_system_prompt(texts, 500, count)


def _fake_server(seen: list[dict]) -> httpx.MockTransport:
    """An OpenAI-style streaming chat server: a role-only chunk, then the answer in two chunks, then
    the usage chunk; it answers 'reply N' to the N-th request it sees."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n, prompt = len(seen), sum(len(m["content"]) for m in body["messages"])
        chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "reply "}}]},
                  {"choices": [{"delta": {"content": str(n)}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": prompt // 2}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handle)


def test_a_session_sends_its_turns_in_order_and_records_each(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    transport = _fake_server(seen)
    client = httpx.Client
    monkeypatch.setattr(multiturn.httpx, "Client", lambda **kwargs: client(transport=transport))
    plan = SessionPlan(("first", "second", "third"))
    wall, records = run_sessions("http://fake", [plan], {"model": "m", "max_tokens": 8, "cache_prompt": True})
    assert wall > 0 and [r.turn for r in records] == [1, 2, 3] and {r.session for r in records} == {1}
    # the third request carries both earlier answers, as the server wrote them
    assert [m["content"] for m in seen[2]["messages"]] == ["first", "reply 1", "second", "reply 2", "third"]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["cache_prompt"] for b in seen)
    r = records[2]
    assert r.prompt_tokens == len("firstreply 1secondreply 2third") and r.cached_tokens == r.prompt_tokens // 2
    assert r.completion_tokens == 2 and r.answer_chars == len("reply 3") and 0 < r.ttft_s <= r.total_s


def _records(ttfts: dict[tuple[int, int], float], cached: int | None = 10) -> list[dict]:
    return [{"session": s, "turn": t, "start_s": 0.0, "ttft_s": v, "total_s": v + 1, "prompt_tokens": 100 * t,
             "cached_tokens": cached, "completion_tokens": 8, "answer_chars": 20} for (s, t), v in ttfts.items()]


def test_the_report_takes_medians_per_turn_and_ratios_to_the_first_target(tmp_path: Path) -> None:
    fast = _records({(1, 1): 1.0, (2, 1): 0.2, (3, 1): 0.4, (1, 4): 0.1, (2, 4): 0.3, (3, 4): 0.2})
    slow = _records({(1, 1): 2.0, (2, 1): 2.0, (3, 1): 3.0, (1, 4): 1.0, (2, 4): 2.0, (3, 4): 4.0}, cached=None)
    rows = per_turn(fast)
    assert [r["turn"] for r in rows] == [1, 4]
    assert rows[0]["ttft_median_s"] == 0.4 and rows[1]["ttft_median_s"] == pytest.approx(0.2)
    assert rows[1]["prompt_tokens_mean"] == 400 and rows[1]["cached_fraction"] == pytest.approx(10 / 400)
    assert per_turn(slow)[0]["cached_tokens_mean"] is None  # not reported is not zero
    assert first_turns(fast) == {"session1_ttft_s": 1.0, "others_median_ttft_s": pytest.approx(0.3),
                                 "others_over_session1": pytest.approx(0.3)}
    results = build_results({"command": "quickdraft bench multiturn", "model": "m", "sessions": 3, "turns": 4,
                             "max_tokens": 8, "threads": 2, "rounds": 1, "cpu": "a CPU", "date": "today"},
                            {"cache": {"rounds": [{"wall_s": 2.0, "records": fast}]},
                             "other": {"rounds": [{"wall_s": 4.0, "records": slow}]}})
    r = results["ratios"]["other"]
    assert r["ttft_per_turn"] == {1: pytest.approx(0.4 / 2.0), 4: pytest.approx(0.2 / 2.0)}
    assert r["ttft_late_median"] == pytest.approx(0.2 / 2.0) and r["output_tokens_per_s"] == pytest.approx(2.0)
    assert results["summary"]["cache"]["output_tokens_per_s"] == 6 * 8 / 2.0
    text = markdown_report(results)
    assert "| 4 | 0.20 | 2.00 | 0.10x |" in text and "| 1 | 100 (10) | 100 (-) |" in text and "a CPU" in text
    written = write_outputs(results, tmp_path)
    assert [p.name for p in written] == ["multiturn.json", "multiturn.md", "ttft.png"]
    assert json.loads(written[0].read_text())["ratios"]["other"]["ttft_mean"] > 0


def test_rounds_alternate_the_order_and_throughput_is_their_median() -> None:
    order = []
    walls = iter([1.0, 2.0, 4.0, 8.0, 3.0, 6.0])

    def one(t: Target) -> dict:
        order.append(t.name)
        return {"command": [t.name], "server": {}, "wall_s": next(walls), "records": _records({(1, 1): 0.5})}

    targets = [Target("a", "quickdraft"), Target("b", "quickdraft", prefix_cache=False)]
    runs = measure_rounds(targets, 3, one)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert [r["wall_s"] for r in runs["a"]["rounds"]] == [1.0, 8.0, 3.0]
    assert [rec["round"] for r in runs["b"]["rounds"] for rec in r["records"]] == [1, 2, 3]
    s = summarize(runs["a"]["rounds"])
    assert s["rounds"] == 3 and s["wall_s"] == 3.0 and s["output_tokens_per_s"] == 8 / 3.0 and s["requests"] == 3


def test_targets_and_their_command_lines() -> None:
    targets = parse_targets("llama-server,quickdraft,no-cache", [4, 2])
    assert [t.name for t in targets] == ["quickdraft", "no-cache", "llama-server-4slots", "llama-server-2slots"]
    assert targets[2].request_fields() == {"cache_prompt": True} and targets[0].request_fields() == {}
    with pytest.raises(QuickdraftError, match="unknown target"):
        parse_targets("quickdraft,vllm", [1])
    s = ServerSettings("smollm2-135m", Path("m.gguf"), threads=2, sessions=4, max_seq_len=4096, prefix_cache_mb=64)
    cache, no_cache = quickdraft_command(s, targets[0], 9000), quickdraft_command(s, targets[1], 9000)
    assert "--prefix-cache-mb" in cache and "--no-prefix-cache" not in cache
    assert "--no-prefix-cache" in no_cache and "--prefix-cache-mb" not in no_cache
    assert cache[cache.index("--threads") + 1] == "2" and cache[cache.index("--spec") + 1] == "none"
    assert cache[cache.index("--host") + 1] == "127.0.0.1" and cache[cache.index("--max-batch") + 1] == "4"
    llama = llama_server_command(Path("llama-server"), s, targets[3], 9001)
    assert llama[llama.index("--parallel") + 1] == "2" and llama[llama.index("--ctx-size") + 1] == str(2 * 4096)
    assert llama[llama.index("--threads-batch") + 1] == "2" and llama[llama.index("--host") + 1] == "127.0.0.1"


def test_replicas_run_one_quickdraft_target_per_router_and_llama_server_gets_every_thread() -> None:
    targets = parse_targets("quickdraft,no-cache,llama-server", [2], ["prefix", "round-robin"])
    assert [(t.name, t.router) for t in targets[:3]] == [("quickdraft-prefix", "prefix"),
                                                         ("quickdraft-round-robin", "round-robin"),
                                                         ("no-cache", "prefix")]
    assert [t.name for t in parse_targets("quickdraft", [2], ["round-robin"])] == ["quickdraft"]
    s = ServerSettings("smollm2-135m", Path("m.gguf"), threads=1, sessions=2, max_seq_len=1024, replicas=2)
    cmd = quickdraft_command(s, targets[1], 9000)
    assert cmd[cmd.index("--replicas") + 1] == "2" and cmd[cmd.index("--router") + 1] == "round-robin"
    assert cmd[cmd.index("--threads") + 1] == "1"
    llama = llama_server_command(Path("llama-server"), s, targets[3], 9001)
    assert llama[llama.index("--threads") + 1] == "2" and llama[llama.index("--threads-batch") + 1] == "2"
    one = ServerSettings("smollm2-135m", None, threads=2, sessions=2, max_seq_len=1024)
    assert "--replicas" not in quickdraft_command(one, targets[0], 9000)


def test_with_replicas_the_report_adds_the_late_cached_share_and_sessions_kept_on_a_replica() -> None:
    def records(replicas: dict[tuple[int, int], str], cached: int) -> list[dict]:
        rows = _records({key: 0.5 for key in replicas}, cached=cached)
        return [{**r, "replica": replicas[(r["session"], r["turn"])]} for r in rows]

    kept = records({(1, 1): "a", (1, 4): "a", (1, 5): "a", (2, 1): "b", (2, 4): "b", (2, 5): "b"}, cached=360)
    moved = records({(1, 1): "a", (1, 4): "b", (1, 5): "a", (2, 1): "b", (2, 4): "b", (2, 5): "b"}, cached=90)
    load = {"a": {"routed": 3, "requests": 3, "prefilled_tokens": 100, "cached_tokens": 300, "generated_tokens": 24,
                  "cached_fraction": 0.75}}
    results = build_results({"command": "quickdraft bench multiturn", "model": "m", "sessions": 2, "turns": 5,
                             "max_tokens": 8, "threads": 1, "rounds": 1, "cpu": "a CPU", "date": "today"},
                            {"quickdraft-prefix": {"rounds": [{"wall_s": 2.0, "records": kept, "replica_load": load}]},
                             "quickdraft-round-robin": {"rounds": [{"wall_s": 2.0, "records": moved}]},
                             "llama-server-2slots": {"rounds": [{"wall_s": 2.0, "records": _records({(1, 4): 1.0})}]}})
    prefix, rr = results["summary"]["quickdraft-prefix"], results["summary"]["quickdraft-round-robin"]
    # turns 4 and 5 of both sessions: 2 x 400 + 2 x 500 prompt tokens
    assert prefix["cached_late_fraction"] == pytest.approx(4 * 360 / 1800) and rr["cached_late_fraction"] == 0.2
    assert prefix["sessions_on_one_replica"] == [2, 2] and rr["sessions_on_one_replica"] == [1, 2]
    assert results["summary"]["llama-server-2slots"]["sessions_on_one_replica"] is None
    text = markdown_report(results)
    assert "| quickdraft-prefix | 80.0% | 2 of 2 |" in text and "| quickdraft-round-robin | 20.0% | 1 of 2 |" in text
    assert "quickdraft-prefix, round 1, per replica:" in text and "| a | 3 | 3 | 400 | 300 | 75.0% | 24 |" in text
    assert "| llama-server-2slots | 2.5% | - |" in text


def test_llama_server_starts_through_the_amx_guard_where_amx_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_server, "has_amx", lambda: True)
    cmd = llama_server.launch_command(Path("bin/llama-server"), ["--threads", "2"])
    assert cmd == [sys.executable, str(llama_server.AMX_GUARD), "bin/llama-server", "--threads", "2"]
    monkeypatch.setattr(llama_server, "has_amx", lambda: False)
    assert llama_server.launch_command(Path("bin/llama-server"), ["-t"]) == ["bin/llama-server", "-t"]


@pytest.mark.skipif(not has_amx(), reason="needs a CPU with AMX")
def test_the_guard_refuses_the_amx_tile_state_to_the_program_it_becomes() -> None:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), what ggml asks before its AMX kernels:
    granted to a plain process (the control), refused with EPERM after the guard's exec."""
    probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
             "print(libc.syscall(158, 0x1023, 18), ctypes.get_errno())")
    run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    assert run([sys.executable, "-c", probe]) == ["0", "0"]
    assert run([sys.executable, str(llama_server.AMX_GUARD), sys.executable, "-c", probe]) == ["-1", str(errno.EPERM)]


def test_llama_server_is_built_from_the_pinned_version_and_needs_cmake(monkeypatch: pytest.MonkeyPatch) -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert llama_server.pinned_version() == re.search(r'"llama-cpp-python==([^"]+)"', pyproject)[1]
    assert llama_server.server_path("0.3.36").parts[-3:] == ("llama-server", "0.3.36", "llama-server")
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: None if name == "cmake" else f"/bin/{name}")
    with pytest.raises(QuickdraftError, match="needs cmake"):
        llama_server.build_llama_server("0.3.36", Path("unused"), lambda line: None)


@pytest.mark.slow
def test_a_real_run_against_quickdraft_serve(tmp_path: Path) -> None:
    """2 sessions x 3 turns against `quickdraft serve` on SmolLM2-135M with its prefix cache."""
    from quickdraft.bench.multiturn_targets import measure
    from quickdraft.weights.resolve import resolve_model
    plans = [SessionPlan(("Name three colours.", "Which of them is the warmest?", "Why?")),
             SessionPlan(("Say hello in French.", "And in Spanish?", "And in German?"))]
    settings = ServerSettings("smollm2-135m", resolve_model("smollm2-135m").path, threads=1, sessions=2,
                              max_seq_len=1024)
    run = measure(Target("quickdraft", "quickdraft"), settings, plans, 8, False, None, dict(os.environ),
                  tmp_path, lambda line: None)
    records = run["records"]
    assert sorted((r["session"], r["turn"]) for r in records) == [(s, t) for s in (1, 2) for t in (1, 2, 3)]
    for s in (1, 2):
        mine = sorted((r for r in records if r["session"] == s), key=lambda r: r["turn"])
        # each turn resends the last: its prompt is longer by at least the answer and the new question
        assert all(b["prompt_tokens"] > a["prompt_tokens"] + a["completion_tokens"] for a, b in zip(mine, mine[1:]))
    assert all(0 < r["ttft_s"] <= r["total_s"] and 1 <= r["completion_tokens"] <= 8 for r in records)
    assert run["server"]["status"] == "ok" and run["wall_s"] > 0
    # The server reports usage.prompt_tokens_details.cached_tokens; from turn 2 on, the history resent
    # starts with tokens the cache holds.
    assert all(r["cached_tokens"] is not None for r in records)
    assert all(r["cached_tokens"] > 0 for r in records if r["turn"] >= 2)


def test_a_server_that_dies_mid_run_is_one_error_naming_it_and_its_log(tmp_path: Path) -> None:
    """A stand-in server (a script answering /health, then closing every chat mid-stream): the run
    ends in a QuickdraftError naming the target and quoting the server's log, not a traceback."""
    from quickdraft.bench import multiturn_targets as mt
    script = tmp_path / "server.py"
    script.write_text('''import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /health, and /metrics with no samples
        self.send_response(200); self.end_headers(); self.wfile.write(b"" if self.path == "/metrics" else b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/completions":
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}"); return
        print("dying mid-answer", flush=True)
        self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        self.wfile.write(b"ff\\r\\ndata: {"); self.wfile.flush(); self.connection.close()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')
    target = Target("stand-in", "quickdraft")
    settings = ServerSettings("m", None, threads=1, sessions=1, max_seq_len=64)
    command = lambda s, t, port: [sys.executable, str(script), str(port)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "quickdraft_command", command)
        with pytest.raises(QuickdraftError, match=r"(?s)stand-in: .*dying mid-answer"):
            mt.measure(target, settings, [SessionPlan(("hi",))], 4, False, None, dict(os.environ), tmp_path,
                       lambda line: None)
