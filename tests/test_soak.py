"""`quickdraft bench soak` (issue 16's acceptance): a short run here; the 5-minute run is by hand or CI
(`quickdraft bench soak --duration 300`). A negative control shows the soak sees a failure."""
from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from quickdraft.bench.soak import Soak
from quickdraft.bench.soak_memory import MAX_RSS_GROWTH, memory_sample, own_rss, prefix_caches
from quickdraft.bench.soak_report import SoakReport
from quickdraft.cli import main
from quickdraft.server.connections import ConnectionLimits
from support.server import NAME, Server


def test_a_short_soak_passes_and_sends_every_kind(dirs, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "soak", "--model", str(dirs[0]), "--duration", "6", "--concurrency", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["failures"] == 0 and report["server_errors"] == 0, report
    assert set(report["sent"]) == {"valid", "conversation", "malformed", "cancelled", "oversized", "slow_body", "stalled",
                                   "huge_prompt", "flood"}
    assert set(report["statuses"]) <= {"200", "400", "404", "405", "408", "413"} and report["statuses"]["413"] > 0
    assert report["left_running"] == 0 and len(report["rss_mb"]) >= 3 and report["prefix_over_budget"] == 0


def test_the_soak_reports_an_answer_it_did_not_expect(llm) -> None:
    """Told the limit is half what it is, its "oversized" bodies are read (and refused for the
    context instead): every one is a failure, and the run fails."""
    s = Server(llm, max_batch=4, connections=ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.0))
    try:
        soak = Soak(s.url, NAME, own_rss, max_body_bytes=(1 << 20) // 2, seed=1, header_timeout_s=1.0,
                    body_timeout_s=1.0)
        report = soak.run(3, 2, warmup_s=0)
    finally:
        s.stop()
    assert not report.passed and report.sent["oversized"] > 0
    assert report.failure_count == report.sent["oversized"], report.failures[:3]
    assert all("expected 413" in f for f in report.failures)
    assert report.server_errors == 0 and report.left_running == 0


def _run_of(rest_mb: Callable[[float], float], cache_mb: Callable[[float], float], budget_mb: float = 2048) -> SoakReport:
    """A 600 s soak's memory, read every 5 s by fake readers (no server): the process's RSS is
    `rest_mb(t)` plus what the prefix cache holds, which /metrics reports as `cache_mb(t)`."""
    report = SoakReport(600, 4, warmup_s=60)
    for t in range(0, 605, 5):
        metrics = (f"# TYPE quickdraft_prefix_cache_bytes gauge\nquickdraft_prefix_cache_bytes {cache_mb(t) * 2**20!r}\n"
                   f"quickdraft_prefix_cache_budget_bytes {budget_mb * 2**20!r}\n"
                   f"quickdraft_prefix_cache_evicted_blocks_total 12.0\n")
        report.memory.append(memory_sample(t, lambda t=t: int((rest_mb(t) + cache_mb(t)) * 2**20), lambda metrics=metrics: metrics))
    return report


def test_memory_is_judged_less_the_prefix_cache_filling_to_its_budget() -> None:
    """Issue 45: RSS 601 -> 2,289 MiB as the default 2 GiB cache fills, the rest flat. Under the old
    rule (RSS alone) that is +170% and a failure; less the cache's bytes it is flat and passes. A
    leak beside the same cache (the rest +10%) still fails, and so does a cache past its budget."""
    filling = lambda t: min(1700.0, 3.0 * t)
    flat = _run_of(lambda t: 600.0 + min(t, 50) + (3.0 if t % 10 else 0.0), filling)  # warms up, then noise alone
    assert flat.rss_growth > 1.0 and not flat.rss_growth < MAX_RSS_GROWTH  # the old rule: a failure
    assert abs(flat.rest_growth) < 0.01 and flat.memory_flat and flat.passed, flat.as_dict()
    report = flat.as_dict()
    assert report["rss_mb"][-1] == (600, 2350.0) and report["prefix_cache_mb"][-1] == (600, 1700.0)
    assert report["rss_less_cache_mb"][-1] == (600, 650.0) and "RSS less the cache 600 -> 650 MiB" in flat.summary()

    leak = _run_of(lambda t: 600.0 + 0.1 * t, filling)  # the rest +9% from the warm-up's end
    assert leak.rest_growth > MAX_RSS_GROWTH and not leak.passed
    over = _run_of(lambda t: 600.0, lambda t: 10.0 * t, budget_mb=2048)  # past its budget from 205 s
    assert over.prefix_over_budget > 0 and not over.passed


def test_every_prefix_cache_on_metrics_is_counted() -> None:
    """The target's cache and any other series of the family (a draft model's, by its labels), each
    against the budget of its own labels."""
    text = ('quickdraft_prefix_cache_bytes 3.0e+06\nquickdraft_prefix_cache_budget_bytes 4.0e+06\n'
            'quickdraft_prefix_cache_bytes{model="draft"} 2.0e+06\nquickdraft_prefix_cache_budget_bytes{model="draft"} 1.0e+06\n'
            'quickdraft_prefix_cache_hit_tokens_total 99.0\n')
    assert prefix_caches(text) == (5_000_000, True)
    assert prefix_caches(text.replace("2.0e+06", "5.0e+05")) == (3_500_000, False)
    assert prefix_caches("quickdraft_requests_running 0.0\n") == (0, False)  # --no-prefix-cache
