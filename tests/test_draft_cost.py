"""A drafter weighs its own forwards (proposers/draft_cost.py): a draft level runs only where its
expected tokens pay for its forward and their verification, except for rows whose draft lengths
must not depend on timing (the fixed policy, seeded sampling), which draft whole ks.

Oracles: plain greedy decoding (every output identical, however much was drafted); the arithmetic
of E / C for `Plan`; counts of drafted tokens and draft forwards against what the rule allows.
"""
from __future__ import annotations

import pytest

from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.policy import StepCost
from quickdraft.proposers.draft_cost import BINS, EXPLORE, Calibration, ForwardTimes, Plan
from quickdraft.proposers.draft_model import DraftModelProposer
from test_batch_engine import Job, greedy, run_batched, target
from test_batched_draft import Counted


def test_calibration_starts_at_the_confidence_and_learns_acceptance() -> None:
    c = Calibration()
    assert c.estimate(0.93) == pytest.approx((int(0.93 * BINS) + 0.5) / BINS)
    assert c.mean == pytest.approx(0.5)
    for _ in range(50):  # confident tokens always accepted, unsure ones never
        c.record([0.96, 0.12], verified=2, accepted=1)
    assert c.estimate(0.96) > 0.95 and c.estimate(0.12) < 0.02


def test_calibration_ignores_tokens_after_the_first_rejection() -> None:
    c = Calibration()
    before = c.estimate(0.55)
    c.record([0.31, 0.55, 0.55], verified=3, accepted=0)  # the first rejected: the rest tell nothing
    assert c.estimate(0.55) == before and c.estimate(0.31) < (int(0.31 * BINS) + 0.5) / BINS
    c.record([0.55, 0.55], verified=1, accepted=1)  # only one was verified (the engine cut the draft)
    assert c.offered[int(0.55 * BINS)] == 2 + 1


def test_a_level_runs_only_where_it_raises_tokens_per_second() -> None:
    # 2 rows: 2 tokens in 10 ms (0.2 per ms). Two gains 0.9 and 0.1; level 5 ms, 1 ms per token:
    # 2.9 / 16 and 3.0 / 17 are both below 0.2: nothing pays
    plan = Plan(2.0, 10.0)
    assert plan.extend([], [0.9, 0.1], 5.0, 1.0) == 0 and (plan.expected, plan.seconds) == (2.0, 10.0)
    # cheap: 2.9 / 10.2 beats 2 / 10, and 3.0 / 10.3 beats both
    plan = Plan(2.0, 10.0)
    assert plan.extend([], [0.9, 0.1], 0.1, 0.1) == 2
    assert (plan.expected, plan.seconds) == (pytest.approx(3.0), pytest.approx(10.3))
    # the best prefix, not all: the weak row's 0.01 costs more than it brings (2.91 / 10.3 < 2.9 / 10.2)
    plan = Plan(2.0, 10.0)
    assert plan.extend([], [0.9, 0.01], 0.1, 0.1) == 1


def test_rows_that_must_draft_pay_the_level_for_the_others() -> None:
    # the level (5 ms) alone would not pay for 0.5 more tokens: with a forced row running it anyway,
    # the other row adds only its verification (0.1 ms)
    alone = Plan(2.0, 10.0)
    assert alone.extend([], [0.5], 5.0, 0.1) == 0
    shared = Plan(2.0, 10.0)
    assert shared.extend([0.2], [0.5], 5.0, 0.1) == 1
    assert shared.seconds == pytest.approx(10.0 + 5.0 + 0.1 + 0.1)


def test_forward_times_are_smoothed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the suite's fixture records draft forwards as free
    t = ForwardTimes()
    t.observe(True, 1.0)
    t.observe(True, 2.0)
    t.observe(False, 0.5)
    assert t.first == pytest.approx(1.2) and t.later == 0.5


def costly_drafts(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every draft forward measured as `seconds`, whatever it took."""
    monkeypatch.undo()
    observe = ForwardTimes.observe
    monkeypatch.setattr(ForwardTimes, "observe", lambda self, first, _: observe(self, first, seconds))


def run_pair(monkeypatch: pytest.MonkeyPatch, policy: str, **sampling) -> tuple[Counted, dict, dict, list[Job]]:
    # the engine's step times stay its prior line (t(N) / t(1) = 1 + 0.1 (N - 1)), whatever else
    # runs on the machine: the verification policy's choices do not hang on load
    monkeypatch.setattr(StepCost, "observe", lambda self, n, seconds: None)
    drafter = Counted(target())  # the target drafting for itself: every draft token is right

    def make(prompt, params):
        return DraftModelProposer(drafter, prompt, params, len(prompt) + params.max_new_tokens + 9)
    jobs = [Job([1, 17, 42, 8, 77, 23], greedy(40, **sampling), make, 4),
            Job([44, 12, 19], greedy(40, **sampling), make, 4, join_at=1)]
    out, last, violations = run_batched(target(), jobs, EngineConfig(max_batch=2, policy=policy), check_kv=False)
    assert violations == []
    return drafter, out, last, jobs


def test_a_draft_too_costly_to_pay_drafts_only_to_explore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft forwards of 10 s against a target pass of milliseconds: no level pays, so a row drafts
    only once every EXPLORE steps (to learn whether acceptance changed); outputs stay plain's."""
    costly_drafts(monkeypatch, 10.0)
    drafter, out, last, jobs = run_pair(monkeypatch, "goodput")
    for i, job in enumerate(jobs):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(target())
    steps = max(last[str(i)].stats.target_passes for i in range(len(jobs)))
    drafted = sum(last[str(i)].stats.drafted_tokens for i in range(len(jobs)))
    # the first measurement costs one full draft per row; then one exploring level per EXPLORE steps
    assert drafted <= len(jobs) * 4 * (2 + steps // EXPLORE)
    assert steps > 20  # the premise: with whole drafts accepted, 40 tokens would take ~8 passes


def test_a_cheap_draft_drafts_and_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pair with draft forwards measured as free: every step drafts, and since every draft
    token is right, 40 tokens take few target passes."""
    drafter, out, last, jobs = run_pair(monkeypatch, "goodput")
    for i, job in enumerate(jobs):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(target())
        assert last[str(i)].stats.target_passes < 20
    assert max(drafter.rows_per_forward) == 2


@pytest.mark.parametrize("policy, sampling", [("fixed", {}), ("goodput", {"temperature": 1.0, "seed": 5})])
def test_rows_whose_lengths_must_not_depend_on_timing_draft_whole_ks(monkeypatch: pytest.MonkeyPatch, policy: str,
                                                                      sampling: dict) -> None:
    """Under the fixed policy, and for seeded sampling, the same costly draft drafts every k."""
    costly_drafts(monkeypatch, 10.0)
    drafter, out, last, jobs = run_pair(monkeypatch, policy, **sampling)
    for i in range(len(jobs)):
        stats = last[str(i)].stats
        assert stats.drafted_tokens >= 4 * (stats.target_passes - 2)  # all but the prefill and a short tail
