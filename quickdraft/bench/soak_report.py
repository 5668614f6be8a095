"""What a soak found: requests sent and statuses seen by kind, failures, memory as the run went, rows
left running; whether it passed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from quickdraft.bench.soak_memory import MAX_RSS_GROWTH, MemorySample, growth


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    sent: Counter = field(default_factory=Counter)            # by kind
    statuses: Counter = field(default_factory=Counter)        # by status, every answer seen
    failures: list[str] = field(default_factory=list)         # what went wrong, the first 50
    failure_count: int = 0
    memory: list[MemorySample] = field(default_factory=list)  # RSS and the prefix caches' bytes, as the run goes
    warmup_s: float = 0.0
    left_running: float = 0.0

    @property
    def rss_growth(self) -> float:
        """RSS at the end over RSS past the warm-up, minus 1: the prefix caches' filling included."""
        return growth(self.memory, self.warmup_s, lambda s: s.rss_mb)

    @property
    def rest_growth(self) -> float:
        """The same for RSS less the prefix caches' bytes: what must stay flat."""
        return growth(self.memory, self.warmup_s, lambda s: s.rest_mb)

    @property
    def prefix_over_budget(self) -> int:
        """Samples of /metrics where a prefix cache held more than its budget."""
        return sum(s.over_budget for s in self.memory)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def memory_flat(self) -> bool:
        return self.rest_growth < MAX_RSS_GROWTH and self.prefix_over_budget == 0

    @property
    def passed(self) -> bool:
        return (self.failure_count == 0 and self.server_errors == 0 and self.memory_flat
                and self.left_running == 0)

    def as_dict(self) -> dict[str, Any]:
        m = self.memory
        return {"duration_s": self.duration_s, "concurrency": self.concurrency, "sent": dict(self.sent),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())}, "server_errors": self.server_errors,
                "failures": self.failure_count, "first_failures": self.failures[:10], "warmup_s": self.warmup_s,
                "rss_mb": [(s.at_s, s.rss_mb) for s in m], "prefix_cache_mb": [(s.at_s, s.cache_mb) for s in m],
                "rss_less_cache_mb": [(s.at_s, s.rest_mb) for s in m], "rss_growth": self.rss_growth,
                "rss_less_cache_growth": self.rest_growth, "left_running": self.left_running,
                "prefix_over_budget": self.prefix_over_budget, "passed": self.passed}

    def summary(self) -> str:
        sent = ", ".join(f"{n} {kind}" for kind, n in sorted(self.sent.items()))
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()))
        first, last = self.memory[0], self.memory[-1]
        return (f"{sum(self.sent.values())} requests in {self.duration_s:.0f} s at concurrency {self.concurrency} "
                f"({sent})\nstatuses: {statuses}\n5xx: {self.server_errors}, failures: {self.failure_count}, rows "
                f"left running: {self.left_running:g}\nRSS {first.rss_mb:.0f} -> {last.rss_mb:.0f} MiB "
                f"({100 * self.rss_growth:+.2f}% after warm-up), of it the prefix cache {first.cache_mb:.0f} -> "
                f"{last.cache_mb:.0f} MiB; RSS less the cache {first.rest_mb:.0f} -> {last.rest_mb:.0f} MiB "
                f"({100 * self.rest_growth:+.2f}% after warm-up, at most {100 * MAX_RSS_GROWTH:g}%), prefix cache over "
                f"its budget in {self.prefix_over_budget} samples\n" + ("PASS" if self.passed else "FAIL"))
