"""A drafter weighs its own forwards (proposers/draft_cost.py): a draft level runs only where its
expected tokens pay for its forward and their verification, except for rows whose draft lengths
must not depend on timing (the fixed policy, seeded sampling), which draft whole ks.

Oracles: plain greedy decoding (every output identical, however much was drafted); the arithmetic
of E / C for `Plan`; counts of drafted tokens and draft forwards against what the rule allows.
"""
from __future__ import annotations

import pytest
import torch

from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.policy import StepCost
from quickdraft.proposers.base import PassCost
from quickdraft.proposers.draft_cost import (
    BINS,
    EXPLORE,
    OWN_WEIGHT,
    OWN_WINDOW,
    Calibration,
    ForwardTimes,
    Plan,
    catch_up_pays,
    expected,
)
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.draft_rows import DraftRow
from quickdraft.spec.draft_contract import Committed
from support.drafts import Counted
from support.engine import Job, draft_state, greedy, run_batched, target


def test_calibration_starts_at_the_confidence_and_learns_acceptance() -> None:
    c = Calibration()
    assert c.estimate(0.93) == pytest.approx((int(0.93 * BINS) + 0.5) / BINS)
    assert c.mean == pytest.approx(0.5)
    for _ in range(50):  # confident tokens always accepted, unsure ones never
        c.record([0.96, 0.12], verified=2, accepted=1)
    assert c.estimate(0.96) > 0.95 and c.estimate(0.12) < 0.02


def test_the_mean_follows_the_evidence_after_one_prior() -> None:
    """11 draft tokens of 11 accepted read ~0.92, not 0.61 (the bins' 20 priors outweighed them, and
    the 0.5B at k = 8 stopped drafting after one HumanEval problem); rejections pull it down as fast."""
    c = Calibration()
    c.record([0.95] * 11, verified=11, accepted=11)
    assert c.mean == pytest.approx(12 / 13)
    c.record([0.4] * 3, verified=3, accepted=0)  # one rejected: the two after it tell nothing
    assert c.mean == pytest.approx(12 / 14)
    for _ in range(40):
        c.record([0.4], verified=1, accepted=0)
    assert c.mean < 0.25


def test_calibration_ignores_tokens_after_the_first_rejection() -> None:
    c = Calibration()
    before = c.estimate(0.55)
    c.record([0.31, 0.55, 0.55], verified=3, accepted=0)  # the first rejected: the rest tell nothing
    assert c.estimate(0.55) == before and c.estimate(0.31) < (int(0.31 * BINS) + 0.5) / BINS
    c.record([0.55, 0.55], verified=1, accepted=1)  # only one was verified (the engine cut the draft)
    assert c.bins[int(0.55 * BINS)].trials == 2 + 1


def test_a_requests_own_record_outweighs_the_mean_of_all_as_it_grows() -> None:
    c = Calibration()
    c.record([0.9] * 40, verified=40, accepted=40)  # every request's drafts so far: accepted
    fresh, missing = DraftRow(0), DraftRow(1)
    assert expected(c, fresh) == pytest.approx(c.mean)  # no record of its own: the mean of all
    missing.record.record(0.0, OWN_WEIGHT)  # as many rejected tokens of its own as the mean weighs
    assert expected(c, missing) == pytest.approx(c.mean / 2)
    for _ in range(100):  # a long run of rejections fades to the last OWN_WINDOW tokens' worth
        missing.record.record(0.0)
        missing.record.recent(OWN_WINDOW)
    assert missing.record.trials == OWN_WINDOW
    for _ in range(16):  # so that half as many accepted ones bring it back above half
        missing.record.record(1.0)
        missing.record.recent(OWN_WINDOW)
    assert expected(c, missing) > 0.5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sampled_rows_record_counts_only_verified_tokens(temperature: float) -> None:
    """A draft of 3 tokens that the committed text repeats, of which the engine verified 1: for a
    greedy row the text is the verifier's verdict on all 3; for a sampled row it is a draw of the
    target's, which matches a draft token less often than verification accepts it: 1 counts."""
    drafter = Counted(target())
    member = DraftModelProposer(drafter, [1, 17, 42, 8], greedy(8, temperature=temperature, seed=3), 20)
    state = drafter.rows.join(member)
    state.offered, state.confidences = [5, 6, 7], [0.9, 0.9, 0.9]
    drafter.learn(member, state, Committed([5, 6, 7, 8], 3, 1, torch.empty(0)))
    assert (state.record.hits, state.record.trials) == ((3.0, 3.0) if temperature == 0 else (1.0, 1.0))
    assert drafter.calibration[temperature == 0].verified == state.record.trials


def test_a_request_whose_drafts_miss_stops_drafting_where_another_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests of one drafter whose every earlier draft token was accepted: one request's own
    tokens are all rejected, the other's accepted. A level pays only for a token accepted more than
    half the time, so the first stops drafting once its own record outweighs the mean of all
    (priced at that mean it would draft at a loss to the end: the 0.5B in translation); the second
    goes on. (The drafts are committed by hand: what is drafted is the point, not the output.)"""
    costly_drafts(monkeypatch, 0.004)  # a level alone in a 10 ms step: (1 + g) / 15 ms > 1 / 10 ms for g > 0.5
    drafter = Counted(target())
    drafter.calibration[True].record([0.9] * 400, verified=400, accepted=400)
    cost = PassCost(seconds=0.01, per_token=0.001, rows=1)
    V = drafter.model.config.vocab_size
    members = [DraftModelProposer(drafter, p, greedy(60), len(p) + 80) for p in ([1, 17, 42, 8], [44, 12, 19, 5])]
    drafted = {0: [], 1: []}
    for _ in range(EXPLORE - 2):  # short of an exploration
        for b, m in enumerate(members):  # each alone in its step
            m.cost = cost
            d = drafter.propose([m], [1])[0]
            drafted[b].append(bool(d.tokens))
            if not d.tokens:
                step = Committed([3], 0, 0, torch.empty(0))
            elif b == 0:  # rejected: the target's token differs
                step = Committed([(d.tokens[0] + 1) % V], 0, 1, torch.empty(0))
            else:
                step = Committed([d.tokens[0], 3], 1, 1, torch.empty(0))
            drafter.commit([m], [step])
    assert all(drafted[1])  # the mean of all stays high
    stop = drafted[0].index(False)
    assert stop == int(OWN_WEIGHT) and not any(drafted[0][stop:])  # after 8 rejected: 0.98 x 8 / (8 + 8) < 0.5
    assert drafter.calibration[True].mean > 0.95


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


def test_a_level_pays_when_its_gain_beats_the_rate() -> None:
    plan = Plan(expected=2.0, seconds=1.0)  # 2 tokens per second
    assert plan.pays(0.5, level_s=0.1, per_token=0.1)       # 2.5 / 1.2 > 2
    assert not plan.pays(0.3, level_s=0.1, per_token=0.1)   # 2.3 / 1.2 < 2
    assert not plan.pays(1.0, level_s=0.5, per_token=0.1)   # even a sure token: 3 / 1.6 < 2
    calibration = Calibration()
    calibration.record([0.99] * 3, verified=3, accepted=1)
    assert calibration.best == pytest.approx(max(b.hits / b.trials for b in calibration.bins))
    assert calibration.best > calibration.mean


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
    t.observe("first", 1.0)
    t.observe("first", 2.0)
    t.observe("later", 0.5)
    t.observe("tree", 0.7)
    assert t.first == pytest.approx(1.2) and t.later == 0.5 and t.tree == 0.7


def costly_drafts(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every draft forward measured as `seconds`, whatever it took."""
    monkeypatch.undo()
    observe = ForwardTimes.observe
    monkeypatch.setattr(ForwardTimes, "observe", lambda self, kind, _: observe(self, kind, seconds))


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


def test_a_draft_that_cannot_pay_even_at_its_best_acceptance_stops_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft forwards of 10 s against a target pass of seconds: no level pays even if every token
    were accepted, so after the first proposal (which measures the forward) no row drafts again,
    not even to explore (its catch-up forwards would be a loss); outputs stay plain's."""
    costly_drafts(monkeypatch, 10.0)
    drafter, out, last, jobs = run_pair(monkeypatch, "goodput")
    for i, job in enumerate(jobs):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(target())
    steps = max(last[str(i)].stats.target_passes for i in range(len(jobs)))
    assert len(drafter.rows_per_forward) <= 4  # the first proposal's k levels, before any forward was measured
    assert steps > 2 * EXPLORE + 1  # the premise: rows idle long enough to have explored twice


def test_a_draft_that_could_pay_at_its_best_acceptance_explores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft forwards of 0.3 s against a target pass of ~1 s: a level pays only for a token accepted
    with probability > ~0.73. With acceptance measured low at every confidence but the highest,
    no row drafts by the mean, but a row whose prompt the draft has explores once every EXPLORE
    idle steps; one whose prompt it never saw does not (its prefill would be paid on the hope of
    the best acceptance)."""
    costly_drafts(monkeypatch, 0.3)
    monkeypatch.setattr(StepCost, "observe", lambda self, n, seconds: None)
    low = Calibration()
    for _ in range(1000):  # rejected at every confidence but the highest, whose bin keeps its prior
        low.record([0.5], verified=1, accepted=0)
    monkeypatch.setattr("quickdraft.proposers.drafter.Calibration", lambda: low)
    assert low.mean < 0.2 and low.best > 0.9
    drafter, out, last, jobs = run_pair(monkeypatch, "goodput")
    for i, job in enumerate(jobs):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(target())
    steps = max(last[str(i)].stats.target_passes for i in range(len(jobs)))
    assert steps > 2 * EXPLORE + 1
    # the first proposal: the first job alone (the second joins a step later), measuring the level
    first_row = drafter.fed[0][0][0]
    explored = [fed for fed in drafter.fed if fed[0][1] >= len(jobs[0].prompt) + EXPLORE]
    assert 2 <= len(explored) <= 2 * (steps // EXPLORE)  # one or two forwards per exploration
    assert all(row == first_row for fed in drafter.fed for row, _ in fed)  # the second job never drafted


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


def test_until_a_level_is_timed_one_row_drafts_the_one_with_least_to_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh drafter has not timed a draft forward, so it cannot weigh a level: one row drafts
    and times it, the one whose catch-up is shortest; the others wait, their prompts not prefilled
    in the draft (a server's first wave prefilled every prompt for drafts its batch could not pay).
    Once timed, the rule decides for every row."""
    monkeypatch.undo()
    drafter = Counted(target())
    cost = PassCost(seconds=0.01, per_token=0.001, rows=3)
    prompts = [[1, 17, 42, 8, 77, 23, 5, 6], [44, 12, 19], [9, 8, 7, 6, 5]]
    members = [DraftModelProposer(drafter, p, greedy(8), len(p) + 20) for p in prompts]
    for m in members:
        m.cost = cost
    drafts = drafter.propose(members, [3, 3, 3])
    assert [len(d.tokens) > 0 for d in drafts] == [False, True, False]
    assert [draft_state(m).cached for m in members] == [0, 3, 0] and drafter.times.first is not None
    drafter.times.first = drafter.times.later = 1e-6  # timed, and nearly free: every row drafts
    drafts = drafter.propose(members, [3, 3, 3])
    assert all(len(d.tokens) > 0 for d in drafts) and [draft_state(m).cached for m in members] == [8, 3, 5]


def test_a_catch_up_is_paid_only_where_drafting_can_repay_it() -> None:
    # a step of 50 ms, 5 ms per verified token; draft forwards of 10 ms; acceptance 0.9, k = 4:
    # chains of 1..4 cost 65, 80, 95, 110 ms for 1.9, 2.71, 3.439, 4.0951 tokens: best 26.86 ms a
    # token (4 levels) against 50, saving 23.14 ms per remaining token
    cost = PassCost(seconds=0.05, per_token=0.005, rows=1)
    saving = 0.05 - 0.110 / (1 + 0.9 + 0.81 + 0.729 + 0.6561)
    assert catch_up_pays(cost, 0.9, 4, 0.01, 0.01, remaining=100, catch_up_s=100 * saving - 1e-6)
    assert not catch_up_pays(cost, 0.9, 4, 0.01, 0.01, remaining=100, catch_up_s=100 * saving + 1e-6)
    # a draft that never pays repays nothing, however long the request
    assert not catch_up_pays(cost, 0.1, 4, 0.05, 0.05, remaining=10**6, catch_up_s=1e-9)


def test_a_prompt_the_draft_cannot_repay_is_not_prefilled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the drafter has timed its forwards and a prompt's catch-up, a request with little left
    to generate skips its prefill in the draft (it would cost more than drafting saves) and drafts
    nothing; one with much left prefills and drafts."""
    monkeypatch.undo()
    drafter = Counted(target())
    drafter.times = ForwardTimes(first=0.01, later=0.01, catch_up=0.01)  # 10 ms a prompt token
    for b in drafter.calibration[True].bins:
        b.hits = 0.9 * b.trials
    prompt = [1, 17, 42, 8, 77, 23, 5, 6, 44, 12, 19, 9]  # 120 ms to catch up on
    short, long = (DraftModelProposer(drafter, prompt, greedy(n), len(prompt) + n + 9) for n in (4, 64))
    for m in (short, long):
        m.cost = PassCost(seconds=0.05, per_token=0.005, rows=2)
    drafts = drafter.propose([short, long], [4, 4])
    assert [len(d.tokens) > 0 for d in drafts] == [False, True]
    assert (draft_state(short).cached, draft_state(long).cached) == (0, len(prompt))  # a saving of ~23 ms a token: 4 do not repay 120 ms


def test_a_row_that_cannot_choose_drafts_while_the_level_is_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded sampled row (no pass cost: its draft lengths must not depend on timing or on other
    rows) drafts its whole k even before the drafter has timed a level; it times the level, and a
    row that can choose waits for that, whichever has less to catch up."""
    monkeypatch.undo()
    drafter = Counted(target())
    pinned = DraftModelProposer(drafter, [1, 17, 42, 8, 77, 23, 5, 6], greedy(8, temperature=1.0, seed=3), 40)
    free = DraftModelProposer(drafter, [44, 12, 19], greedy(8), 40)
    free.cost = PassCost(seconds=0.01, per_token=0.001, rows=2)
    drafts = drafter.propose([pinned, free], [3, 3])
    assert [len(d.tokens) for d in drafts] == [3, 0]
