"""The soak's memory measure: the serving process's resident memory against what its prefix caches
hold (read from /metrics), sampled as the load runs; the rest must stay flat after a warm-up.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

MAX_RSS_GROWTH = 0.05  # of the memory beside the prefix caches, after the warm-up


def own_rss() -> int:
    """This process's resident memory in bytes (Linux: /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemorySample:
    at_s: float      # seconds into the load
    rss_mb: float    # the serving process's resident memory, MiB
    cache_mb: float  # of it, what the prefix caches hold (/metrics), MiB
    over_budget: bool = False  # a prefix cache held more than its budget

    @property
    def rest_mb(self) -> float:
        """The memory that must stay flat: RSS less the prefix caches' bytes."""
        return self.rss_mb - self.cache_mb


def prefix_caches(metrics: str) -> tuple[int, bool]:
    """(bytes the prefix caches hold, whether one holds more than its budget) from /metrics' text:
    every series of quickdraft_prefix_cache_bytes (each cache's, by its labels), against the budget
    of the same labels; (0, False) with none."""
    held: dict[str, float] = {}
    budget: dict[str, float] = {}
    for line in metrics.splitlines():
        for name, into in (("quickdraft_prefix_cache_bytes", held), ("quickdraft_prefix_cache_budget_bytes", budget)):
            if line.startswith((f"{name} ", f"{name}{{")):
                series, value = line.rsplit(maxsplit=1)
                into[series[len(name):]] = float(value)
    return int(sum(held.values())), any(b > budget[labels] for labels, b in held.items() if labels in budget)


def memory_sample(at_s: float, rss: Callable[[], int], metrics: Callable[[], str]) -> MemorySample:
    """RSS and the prefix caches' bytes now: `rss` the serving process's bytes, `metrics` its /metrics."""
    cache, over = prefix_caches(metrics())
    return MemorySample(round(at_s, 1), rss() / 2**20, cache / 2**20, over)


def growth(samples: list[MemorySample], warmup_s: float, of: Callable[[MemorySample], float]) -> float:
    """The last sample's `of` over that of the first sample past the warm-up (the first sample's if
    none is), minus 1."""
    base = next((s for s in samples[:-1] if s.at_s >= warmup_s), samples[0])
    return of(samples[-1]) / of(base) - 1
