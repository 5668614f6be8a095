"""Per-replica load as a server's /metrics text tells it: the requests the front routed to each
replica, and each replica's finished requests, prompt tokens (prefilled and found in its prefix
cache) and generated tokens, read from the `replica` label the front's merge adds. One process's
metrics have no such label: one row, ONE_PROCESS.

Plain Prometheus text, no Ray: the benchmarks (bench serve, bench multiturn) read it over HTTP.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ONE_PROCESS = "(one process)"
SAMPLES = {  # sample name -> ReplicaLoad field
    "quickdraft_cluster_routed_requests_total": "routed",
    "quickdraft_requests_total": "requests",
    "quickdraft_prompt_tokens_total": "prefilled_tokens",
    "quickdraft_prefix_cache_hit_tokens_total": "cached_tokens",
    "quickdraft_generated_tokens_total": "generated_tokens",
}


@dataclass(frozen=True)
class ReplicaLoad:
    routed: int = 0            # sent there by the front (retries included); 0 for one process
    requests: int = 0          # finished there, any finish reason
    prefilled_tokens: int = 0  # prompt tokens it computed
    cached_tokens: int = 0     # prompt tokens its prefix cache held
    generated_tokens: int = 0

    @property
    def cached_fraction(self) -> float | None:
        prompt = self.prefilled_tokens + self.cached_tokens
        return self.cached_tokens / prompt if prompt else None

    def minus(self, earlier: ReplicaLoad) -> ReplicaLoad:
        return ReplicaLoad(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int | float | None]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "cached_fraction": self.cached_fraction}


def replica_loads(metrics_text: str) -> dict[str, ReplicaLoad]:
    """Replica name -> its counters, from a /metrics text (a replica the front routed to but that no
    longer reports, e.g. one restarted, keeps its routed count)."""
    counts: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = SAMPLES.get(sample.name)
            if name is not None:
                row = counts.setdefault(sample.labels.get("replica", ONE_PROCESS), {})
                row[name] = row.get(name, 0) + round(sample.value)
    return {replica: ReplicaLoad(**row) for replica, row in sorted(counts.items())}


def load_between(before: Mapping[str, ReplicaLoad], after: Mapping[str, ReplicaLoad]) -> dict[str, ReplicaLoad]:
    """What each replica did between two readings (a replica new since `before` started from zero)."""
    return {replica: load.minus(before.get(replica, ReplicaLoad())) for replica, load in after.items()}


def load_table(loads: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table, one row per replica, from ReplicaLoad.as_dict()s (as a report's JSON holds them)."""
    lines = ["| replica | routed | requests | prompt tokens | cached | cached share | generated tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for replica, r in loads.items():
        share = "-" if r["cached_fraction"] is None else f"{r['cached_fraction']:.1%}"
        lines.append(f"| {replica} | {r['routed']} | {r['requests']} | {r['prefilled_tokens'] + r['cached_tokens']:,} "
                     f"| {r['cached_tokens']:,} | {share} | {r['generated_tokens']:,} |")
    return "\n".join(lines) + "\n"
