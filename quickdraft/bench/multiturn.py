"""`quickdraft bench multiturn`'s clients: chat sessions that resend their whole history each turn,
as a chat client does, against any OpenAI-compatible server.

Owns the sessions (ShareGPT conversations of at least `turns` user turns, none holding a benchmark
question, each user turn cut to a character limit; optionally one shared system prompt) and running
them concurrently over HTTP, streaming, recording per turn the time to the first content chunk and
the server's usage (prompt, cached, completion tokens). Knows nothing of how the servers start
(multiturn_targets.py) or how the numbers are reported (multiturn_report.py).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import httpx

from quickdraft.bench.sse import sse_chunks
from quickdraft.cluster import REPLICA_HEADER
from quickdraft.model.tokenizer import Message

SPARE_ANSWERS = 64  # ShareGPT answers average a few hundred tokens: a shared system prompt of 10k+
SYSTEM_PREAMBLE = "You are a helpful assistant. Use the reference notes below where they help.\n\n"


@dataclass(frozen=True)
class SessionPlan:
    user_turns: tuple[str, ...]
    system: str | None = None


@dataclass
class TurnRecord:
    session: int            # 1-based
    turn: int               # 1-based
    start_s: float          # when the request was sent, since the run began
    ttft_s: float           # to the first content chunk (to the end when the answer is empty)
    total_s: float
    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    completion_tokens: int
    answer_chars: int
    replica: str | None = None  # the replica that answered (a cluster's x-quickdraft-replica header)


def truncate(text: str, max_chars: int) -> str:
    """At most max_chars characters, cut at the last space before the limit where there is one (a
    word cut in half tokenizes oddly)."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ")
    return (cut[:space] if space > max_chars // 2 else cut).rstrip()


def plan_sessions(conversations: Iterable[list[Message]], sessions: int, turns: int,
                  max_chars: int) -> tuple[list[SessionPlan], list[str]]:
    """The first `sessions` conversations with at least `turns` user turns, each turn truncated; and
    SPARE_ANSWERS assistant answers of the conversations after them (text none of the sessions holds,
    for a shared system prompt)."""
    plans: list[SessionPlan] = []
    spare: list[str] = []
    for messages in conversations:
        users = [m["content"] for m in messages if m["role"] == "user"]
        if len(plans) < sessions and len(users) >= turns:
            plans.append(SessionPlan(tuple(truncate(u, max_chars) for u in users[:turns])))
        elif len(plans) == sessions:
            spare += [m["content"] for m in messages if m["role"] == "assistant"]
            if len(spare) >= SPARE_ANSWERS:
                break
    return plans, spare


def shared_system_prompt(texts: Sequence[str], n_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """A system prompt of about n_tokens tokens (at most n_tokens): SYSTEM_PREAMBLE and then `texts`
    joined, cut at the last word that keeps it within n_tokens."""
    words = (SYSTEM_PREAMBLE + "\n\n".join(texts)).split(" ")
    if count_tokens(" ".join(words)) < n_tokens:
        raise ValueError(f"the spare text holds fewer than {n_tokens} tokens")
    lo, hi = 0, len(words)  # the most words within n_tokens lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count_tokens(" ".join(words[:mid])) <= n_tokens else (lo, mid)
    return " ".join(words[:lo])


def history(plan: SessionPlan, answers: Sequence[str], turn: int) -> list[Message]:
    """What the client sends at `turn` (1-based): the system prompt, every earlier user turn and the
    server's own answer to it, then this turn's user message."""
    assert len(answers) >= turn - 1, "a turn is sent after the answers before it"
    messages: list[Message] = [{"role": "system", "content": plan.system}] if plan.system else []
    for i in range(turn - 1):
        messages += [{"role": "user", "content": plan.user_turns[i]}, {"role": "assistant", "content": answers[i]}]
    return messages + [{"role": "user", "content": plan.user_turns[turn - 1]}]


@dataclass
class Answer:
    text: str
    ttft_s: float
    total_s: float
    usage: dict[str, Any]
    replica: str | None = None


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> Answer:
    """One streaming chat request (usage asked for in the last chunk); TTFT as the client sees it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, usage = None, [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as r:
        replica = r.headers.get(REPLICA_HEADER)
        for chunk in sse_chunks(r, url):
            usage = chunk.get("usage") or usage
            delta = (chunk["choices"][0].get("delta") or {}).get("content") if chunk.get("choices") else None
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                parts.append(delta)
    total = time.perf_counter() - start
    if usage is None:
        raise RuntimeError(f"{url} sent no usage (stream_options.include_usage)")
    return Answer("".join(parts), total if ttft is None else ttft, total, usage, replica)


def cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


def run_session(url: str, plan: SessionPlan, index: int, body: dict[str, Any], t0: float,
                on_turn: Callable[[TurnRecord], None]) -> list[TurnRecord]:
    """One session's turns in order, each sent once the answer before it is complete."""
    records, answers = [], []
    # a connection per request: llama-server's HTTP library closes kept-alive connections on its own
    # schedule, and a request sent on one it has just closed fails (a local connect costs ~0.1 ms)
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for turn in range(1, len(plan.user_turns) + 1):
            sent = time.perf_counter() - t0
            a = stream_chat(client, url, {**body, "messages": history(plan, answers, turn)})
            answers.append(a.text)
            u = a.usage
            records.append(TurnRecord(index, turn, sent, a.ttft_s, a.total_s, int(u["prompt_tokens"]),
                                      cached_tokens(u), int(u["completion_tokens"]), len(a.text), a.replica))
            on_turn(records[-1])
    return records


def run_sessions(url: str, plans: Sequence[SessionPlan], body: dict[str, Any], lead_session: bool = False,
                 on_turn: Callable[[TurnRecord], None] = lambda r: None) -> tuple[float, list[TurnRecord]]:
    """Every session at once on a thread of its own; returns the wall seconds and the records.
    `lead_session`: the others start once session 1's first turn is answered (what the first reader
    of a shared system prompt pays, then the rest)."""
    led = threading.Event()
    if not lead_session:
        led.set()

    def on_record(r: TurnRecord) -> None:
        on_turn(r)
        if r.session == 1:
            led.set()

    def one(index: int) -> list[TurnRecord]:
        try:
            if index > 1:
                led.wait()
            return run_session(url, plans[index - 1], index, body, t0, on_record)
        finally:
            led.set()  # a failed first session must not leave the others waiting

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [pool.submit(one, i) for i in range(1, len(plans) + 1)]
        records = [r for f in futures for r in f.result()]
    return time.perf_counter() - t0, records
