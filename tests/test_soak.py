"""`quickdraft bench soak` (issue 16's acceptance): a short run here; the 5-minute run is by hand or CI
(`quickdraft bench soak --duration 300`). A negative control shows the soak sees a failure."""
from __future__ import annotations

import json

import pytest

from quickdraft.bench.soak import Soak, own_rss
from quickdraft.cli import main
from quickdraft.server.connections import ConnectionLimits
from test_server import NAME, Server, dirs, llm  # noqa: F401 (fixtures)


def test_a_short_soak_passes_and_sends_every_kind(dirs, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    assert main(["bench", "soak", "--model", str(dirs[0]), "--duration", "6", "--concurrency", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["failures"] == 0 and report["server_errors"] == 0, report
    assert set(report["sent"]) == {"valid", "conversation", "malformed", "cancelled", "oversized", "slow_body", "stalled",
                                   "huge_prompt", "flood"}
    assert set(report["statuses"]) <= {"200", "400", "404", "405", "408", "413"} and report["statuses"]["413"] > 0
    assert report["left_running"] == 0 and len(report["rss_mb"]) >= 3 and report["prefix_over_budget"] == 0


def test_the_soak_reports_an_answer_it_did_not_expect(llm) -> None:  # noqa: F811
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
