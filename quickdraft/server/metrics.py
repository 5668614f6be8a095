"""Prometheus metrics of one server: requests, tokens, drafts and acceptance, queue, step time,
the prefix cache.

Counters advance as token events arrive (deltas of each request's cumulative stats), so a long
request shows up while it runs. One registry per server, never the process-global one.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.kv.prefix_cache import BLOCK, PrefixCache

PREFIX = "quickdraft"
LATENCY_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, prefix: PrefixCache | None = None) -> None:
        """prefix: the model's prefix cache, whose size and evictions are read at scrape time."""
        self.registry = CollectorRegistry()
        self.prefix = prefix
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by finish reason "
                                "(stop, length, error, cancelled)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the "
                                     "prefix cache (not prefilled)", registry=r)
        self.generated = Counter(f"{PREFIX}_generated_tokens", "New tokens generated", registry=r)
        self.drafted = Counter(f"{PREFIX}_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter(f"{PREFIX}_accepted_tokens", "Draft tokens accepted", registry=r)
        self.passes = Counter(f"{PREFIX}_target_passes", "Target passes per request row (a batched "
                              "step counts once per row)", registry=r)
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests holding a batch row", registry=r)
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests waiting for a batch row", registry=r)
        self.step_s = Histogram(f"{PREFIX}_step_seconds", "Engine step time (one target pass for the batch)",
                                buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56, 5.12),
                                registry=r)
        self.ttft_s = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival -> its first token, "
                                "for requests that got one", buckets=LATENCY_BUCKETS, registry=r)
        self.request_s = Histogram(f"{PREFIX}_request_seconds", "Request arrival -> its last token, for "
                                   "requests that finished (stop or length)", buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter(f"{PREFIX}_rejected_requests", "Answers with an error status, by status (4xx: "
                              "refused; 499: the client left; 5xx: failed)", ["status"], registry=r)
        self._lock = threading.Lock()
        self._last: dict[str, GenerationStats] = {}  # per running request: stats already counted
        self._totals = {"committed": 0, "passes": 0, "drafted": 0, "accepted": 0}  # for the ratios
        self._drafted_at: list[int] = []
        self._accepted_at: list[int] = []
        r.register(_Derived(self))

    def count_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def observe_step(self, seconds: float) -> None:
        self.step_s.observe(seconds)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_event(self, request_id: str, event: TokenEvent) -> None:
        new, old = event.stats, self._last.get(request_id, GenerationStats())
        if not old.target_passes and new.target_passes:
            self.prompt_tokens.inc(new.prompt_tokens - new.cached_tokens)
            self.cached_tokens.inc(new.cached_tokens)
        self.generated.inc(new.new_tokens - old.new_tokens)
        self.drafted.inc(new.drafted_tokens - old.drafted_tokens)
        self.accepted.inc(new.accepted_tokens - old.accepted_tokens)
        self.passes.inc(new.target_passes - old.target_passes)
        with self._lock:
            t = self._totals
            t["committed"] += new.committed_tokens - old.committed_tokens
            t["passes"] += new.target_passes - old.target_passes
            t["drafted"] += new.drafted_tokens - old.drafted_tokens
            t["accepted"] += new.accepted_tokens - old.accepted_tokens
            for i, (d, a) in enumerate(zip(new.drafted_at, new.accepted_at)):
                if i >= len(self._drafted_at):
                    self._drafted_at.append(0)
                    self._accepted_at.append(0)
                self._drafted_at[i] += d - (old.drafted_at[i] if i < len(old.drafted_at) else 0)
                self._accepted_at[i] += a - (old.accepted_at[i] if i < len(old.accepted_at) else 0)
        self._last[request_id] = new

    def finish(self, request_id: str, reason: str) -> None:
        self._last.pop(request_id, None)
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Derived:
    """Ratios computed at scrape time from the counters above."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self):
        m = self.m
        with m._lock:
            drafted_at, accepted_at, t = list(m._drafted_at), list(m._accepted_at), dict(m._totals)
        yield GaugeMetricFamily(f"{PREFIX}_acceptance_rate", "Accepted / drafted tokens, all requests",
                                value=t["accepted"] / t["drafted"] if t["drafted"] else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_tokens_per_pass", "Mean tokens committed per target pass "
                                "per request row (1.0 = plain decoding)",
                                value=t["committed"] / t["passes"] if t["passes"] else 0.0)
        by_pos = GaugeMetricFamily(f"{PREFIX}_acceptance_rate_by_position",
                                   "Acceptance rate of draft tokens at each draft position (1-based)",
                                   labels=["position"])
        for i, (d, a) in enumerate(zip(drafted_at, accepted_at)):
            by_pos.add_metric([str(i + 1)], a / d if d else 0.0)
        yield by_pos
        if m.prefix is not None:
            stats = m.prefix.stats
            yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_bytes", "Bytes of K/V the prefix cache holds",
                                    value=stats.bytes)
            yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_budget_bytes", "The prefix cache's budget",
                                    value=m.prefix.budget_bytes)
            yield CounterMetricFamily(f"{PREFIX}_prefix_cache_evicted_blocks", "Blocks of "
                                      f"{BLOCK} tokens (or a sequence's shorter last piece) evicted to stay within the budget", value=stats.evictions)
            pool = m.prefix.pool  # the running rows' blocks and the prefix cache's, each held once
            yield GaugeMetricFamily(f"{PREFIX}_kv_blocks_used", f"K/V blocks of {BLOCK} tokens that rows or the "
                                    "prefix cache hold (a block several hold counts once)", value=pool.used)
            yield GaugeMetricFamily(f"{PREFIX}_kv_blocks_reserved", "K/V blocks that take memory (written "
                                    "at least once; free ones are reused first)", value=pool.in_memory)
            yield GaugeMetricFamily(f"{PREFIX}_kv_block_bytes", "Bytes of one K/V block, every layer",
                                    value=pool.block_bytes)
