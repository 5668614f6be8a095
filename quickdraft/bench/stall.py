"""`quickdraft bench stall`: what a long prompt's prefill costs a stream already running.

One stream decodes on the model's engine; once it has settled, a long prompt arrives. The stream's
gaps between tokens while that prompt is prefilled (chunked, engine/prefill.py) are compared with
its gaps before, in the same run. The engine is driven from the calling thread, as a server drives
it (no second thread runs torch).

Knows the engine service and the clock; nothing of HTTP or of how chunks are sized.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from quickdraft.api import LLM
from quickdraft.engine.events import TokenEvent
from quickdraft.proposers import SpecConfig
from quickdraft.spec.sampling import SamplingParams

SETTLE = 8  # the stream's first gaps (its prompt, the policy's first timings) are not its usual step


@dataclass(frozen=True)
class StallRound:
    usual_gap_s: float       # the stream's median gap between tokens before the long prompt came
    gaps_s: list[float]      # its gaps while the long prompt was prefilled
    prompt_tokens: int       # the long prompt's
    cached_tokens: int       # of them found in the prefix cache
    prefill_s: float         # from its arrival to its first token

    @property
    def worst(self) -> float:
        """The longest gap during the prefill, in usual gaps (the issue's goal: <= 3)."""
        return max(self.gaps_s, default=0.0) / self.usual_gap_s

    def to_dict(self) -> dict:
        return {**asdict(self), "worst_ratio": self.worst,
                "median_ratio": statistics.median(self.gaps_s) / self.usual_gap_s if self.gaps_s else 0.0}


def measure_round(llm: LLM, stream_ids: list[int], long_ids: list[int], usual_tokens: int = 24) -> StallRound:
    """The stream (greedy, plain decoding) runs `SETTLE + usual_tokens` tokens alone, then the long
    prompt arrives; both end once the long prompt has its first token."""
    service = llm.engine_service()
    times: list[float] = []  # when each of the stream's events with tokens came
    ended: list[TokenEvent] = []  # the stream's last event, should it end (an error)
    first: list[TokenEvent] = []

    def stream_sink(event: TokenEvent) -> None:
        times.extend([time.perf_counter()] * bool(event.token_ids))
        ended.extend([event] * (event.finish_reason is not None))

    # room for a token a step while the long prompt is prefilled, at least a token a step (its K/V
    # cache is reserved for all of it at admission: not the whole context)
    budget = SETTLE + usual_tokens + len(long_ids) + 64
    plain = SpecConfig(method="none")  # a token a step (SpecConfig() drafts with prompt lookup)
    stream, make = llm.request(stream_ids, SamplingParams(max_new_tokens=budget, ignore_eos=True), plain)
    service.submit(stream, stream_sink, make)
    while len(times) < SETTLE + usual_tokens + 1 and not ended:
        service.drive()
    arrived = time.perf_counter()
    long, make_long = llm.request(long_ids, SamplingParams(max_new_tokens=1), plain)
    service.submit(long, first.append, make_long)
    while not first:
        service.drive()
    done = time.perf_counter()
    service.cancel(stream.id)
    service.drive(step=False)
    for event in (*ended, *first):
        if event.error is not None:
            raise event.error
    if ended:
        raise RuntimeError(f"the running stream ended ({ended[0].finish_reason}) before the long prompt came")
    before = [b - a for a, b in zip(times[SETTLE:], times[SETTLE + 1:]) if b <= arrived]
    during = [b - a for a, b in zip(times, times[1:]) if arrived < b <= done]  # the gap it arrived in too
    return StallRound(statistics.median(before), during, len(long_ids), first[0].stats.cached_tokens, done - arrived)


def long_prompt(llm: LLM, tokens: int, salt: int) -> list[int]:
    """`tokens` ids of plain prose, different for every salt from the first token on (no prefix-cache
    hit between rounds or with the stream's prompt)."""
    words = ("the river bends past the old mill where nobody has worked for years and the water runs "
             "slow and brown under the bridge").split()
    text = f"{salt}: note {salt}. " + " ".join(f"{words[(i * 7 + salt) % len(words)]}" for i in range(2 * tokens))
    ids = llm.tokenizer.encode(text)
    if len(ids) < tokens:
        raise ValueError(f"could not make a prompt of {tokens} tokens")
    return ids[:tokens]
