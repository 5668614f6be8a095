"""The batched engine: every row of a batch decodes exactly as its request would alone.

Oracles: the same request run alone through generate_tokens (token for token, greedy and seeded
sampling), K/V recomputed from scratch for each cache row after every step, the exact law of the
first sampled tokens (chi-square) for rows sampled inside full batches.
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable, Sequence

import pytest
import torch

import quickdraft.spec.verify as verify_module
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.loop import generate_tokens
from quickdraft.engine.policy import STALE, RowDraft, StepCost, choose_draft_lengths
from quickdraft.errors import ContextTooLong
from quickdraft.proposers.base import EACH, NO_DRAFT, Committed, Draft
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.head import MAX_REST, Rest
from quickdraft.proposers.hybrid import HybridProposer
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.engine import (
    JOBS,
    OUT_OF_VOCAB,
    Job,
    ProposerFactory,
    draft_random,
    first_tokens_in_batches,
    greedy,
    ngram,
    run_batched,
    target,
)
from support.laws import N_SAMPLES, PROMPT16, SAMPLE_K, SAMPLE_NEW, assert_plain_sampling_law
from support.models import tiny16, tiny16_draft


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_batched_greedy_equals_each_request_alone(policy: str) -> None:
    model = target()
    ragged = []

    def watch(engine: Engine, step: int) -> None:
        offers = {len(r.draft.tokens) for r in engine.rows}
        ragged.append(len(engine.rows) > 1 and len(offers) > 1)

    out, last, violations = run_batched(model, JOBS, EngineConfig(max_batch=4, policy=policy), on_step=watch)
    assert violations == []
    for i, job in enumerate(JOBS):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    stats = {rid: ev.stats for rid, ev in last.items()}
    assert last["6"].finish_reason == "stop" and last["0"].finish_reason == "length"
    if policy == "fixed":  # the premises: ragged drafts in one pass, most accepted for draft == target
        assert any(ragged)
        assert stats["3"].acceptance_rate == 1.0
        assert stats["1"].drafted_tokens > 0 and 0 < stats["1"].accepted_tokens < stats["1"].drafted_tokens
        assert stats["4"].acceptance_rate < 0.3


def test_cancel_frees_rows_and_others_continue() -> None:
    model = target()
    jobs = JOBS[:4]

    def cancel(engine: Engine, step: int) -> None:
        if step == 4:
            assert engine.cancel("1") and engine.num_running == 2  # "2" and "3" still run
            assert not engine.cancel("1")
        if step == 5:
            assert not engine.cancel("nope")

    out, _, violations = run_batched(model, jobs, EngineConfig(max_batch=3), on_step=cancel)
    assert violations == []
    for i in (0, 2, 3):
        assert out[str(i)] == jobs[i].alone(model)
    assert len(out["1"]) < jobs[1].params.max_new_tokens


def test_cancel_waiting_request() -> None:
    engine = Engine(target(), EngineConfig(max_batch=1))
    engine.add(JOBS[0].request("a"))
    engine.add(JOBS[1].request("b"))
    engine.step()
    assert engine.num_waiting == 1 and engine.cancel("b") and engine.num_waiting == 0


def test_seeded_sampling_reproduces_whatever_shares_the_batch() -> None:
    model = target()
    sampled = [Job([5, 6, 7, 8, 5, 6, 7], greedy(30, temperature=1.0, seed=s), make, k, join_at=j)
               for s, make, k, j in [(11, ngram, 6, 0), (12, draft_random, 3, 2), (13, None, 0, 1)]]
    others = [Job([1, 2, 3], greedy(25, temperature=0.8, top_p=0.9), ngram, 4),
              Job([4, 4, 9, 4, 4, 9], greedy(20), ngram, 8, join_at=1)]
    alone = [job.alone(model) for job in sampled]
    for mix in (sampled + others, others + sampled):
        out, _, _ = run_batched(model, mix, EngineConfig(max_batch=3), check_kv=False)
        for i, job in enumerate(mix):
            if job in sampled:
                assert out[str(i)] == alone[sampled.index(job)]
    assert alone[0] != alone[2]  # the seeds matter


def test_a_steps_tokens_go_out_before_the_next_draft_is_asked_for() -> None:
    """A step returns its tokens before any proposer drafts for the next step (a draft model's
    forwards, or its prompt's prefill, would otherwise delay every emitted token and the first
    one), and the proposals are made at the start of the next step, before its pass."""
    log: list[str] = []

    class Logged(NgramProposer):
        def propose(self, k: int) -> Draft:
            log.append("propose")
            return super().propose(k)

    engine = Engine(target(), EngineConfig(max_batch=2))
    engine.add(Request([1, 2, 3, 1, 2], greedy(6), frozenset(), Logged([1, 2, 3, 1, 2], 4, 1), 4, id="a"))
    first = engine.step()  # the prompt's pass
    assert [e.token_ids for _, e in first] != [[]] and log == []
    engine.add(Request([7, 8, 7], greedy(6), frozenset(), Logged([7, 8, 7], 4, 1), 4, id="b"))
    second = engine.step()  # a's draft, its pass; then b's prompt pass
    assert log == ["propose"] and {rid for rid, _ in second} == {"a", "b"}
    engine.step()
    assert log == ["propose"] * 3  # a's and b's drafts for this step, asked together


def test_failing_proposer_ends_only_its_request() -> None:
    class Broken:
        group = EACH

        def propose(self, k: int) -> Draft:
            raise RuntimeError("proposer exploded")

        def commit(self, step: Committed) -> None:
            pass

    model = target()
    engine = Engine(model, EngineConfig(max_batch=2))
    engine.add(Request([1, 2, 3], greedy(10), proposer=Broken(), k=2, id="bad"))
    engine.add(JOBS[1].request("good"))
    events: dict[str, list] = {"bad": [], "good": []}
    while engine.has_work():
        for rid, event in engine.step():
            events[rid].append(event)
    assert events["bad"][-1].finish_reason == "error" and "exploded" in str(events["bad"][-1].error)
    assert [t for e in events["good"] for t in e.token_ids] == JOBS[1].alone(model)


def test_a_proposer_without_a_group_drafts_alone() -> None:
    """`group = None` meant "drafts alone" before the engine asked groups only: such a proposer (one
    written for that protocol) is asked as EACH's members are, its output plain decoding's."""
    class Old:
        group = None

        def __init__(self) -> None:
            self.inner = NgramProposer([1, 2, 3, 1, 2], 4, 1)

        def propose(self, k: int) -> Draft:
            return self.inner.propose(k)

        def commit(self, step: Committed) -> None:
            self.inner.commit(step)

    model = target()
    engine = Engine(model, EngineConfig(max_batch=2))
    old = Old()
    engine.add(Request([1, 2, 3, 1, 2], greedy(12), proposer=old, k=4, id="old"))
    engine.add(JOBS[1].request("new"))
    events: dict[str, list] = {"old": [], "new": []}
    while engine.has_work():
        for rid, event in engine.step():
            events[rid].append(event)
    plain, alone = Engine(model, EngineConfig(max_batch=1)), []
    plain.add(Request([1, 2, 3, 1, 2], greedy(12), id="plain"))
    while plain.has_work():
        alone += [t for _, e in plain.step() for t in e.token_ids]
    assert events["old"][-1].error is None and events["new"][-1].error is None
    assert [t for e in events["old"] for t in e.token_ids] == alone
    assert [t for e in events["new"] for t in e.token_ids] == JOBS[1].alone(model)
    assert events["old"][-1].stats.drafted_tokens > 0


# -- a request whose pass fails ends alone ----------------------------------------------------------------

BAD_SEED = 666


class PoisonedLookup:
    """Prompt lookup, except that its `at`-th proposal is a token id past the vocabulary: the
    target's pass fails on it, whoever shares the pass."""
    group = EACH

    def __init__(self, prompt: Sequence[int], at: int) -> None:
        self.inner, self.at, self.asked = NgramProposer(prompt, 4, 1), at, 0

    def propose(self, k: int) -> Draft:
        self.asked += 1
        return Draft([OUT_OF_VOCAB], None) if self.asked == self.at else self.inner.propose(k)

    def commit(self, step: Committed) -> None:
        self.inner.commit(step)


def poisoned(at: int) -> ProposerFactory:
    return lambda prompt, params: PoisonedLookup(prompt, at)


def nan_for_seed(monkeypatch: pytest.MonkeyPatch, seed: int, calls: Callable[[int], bool]) -> None:
    """The target's p is NaN (what a temperature of 1e-38 used to give) for the request seeded
    `seed`, at its n-th verification when calls(n): multinomial raises on it."""
    real, seen = verify_module.probabilities, [0]

    def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        if params.seed == seed:
            seen[0] += 1
            if calls(seen[0]):
                return torch.full(logits.shape, float("nan"))
        return real(logits, params)

    monkeypatch.setattr(verify_module, "probabilities", probabilities)


# Greedy and seeded rows, some with proposers: the requests that must not notice a failing one.
# The seeded rows sit before the failing ones, so the failed pass has drawn from their generators.
BYSTANDERS = [
    Job([1, 17, 42, 8, 77, 23], greedy(30), None, 0),
    Job([5, 6, 7, 8, 5, 6, 7], greedy(30, temperature=0.9, seed=21), draft_random, 3),
    Job([9, 2, 9, 2, 9, 2, 9], greedy(30, temperature=1.0, seed=22), None, 0),
    Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(30), ngram, 8, join_at=2),  # waits for a row
]
FAULTS = {
    # name: (failing jobs, appended after the bystanders; do they end with an error)
    "target pass": ([Job([3, 3, 4, 5, 3, 3, 4], greedy(30), poisoned(4), 2)], True),
    "two target passes": ([Job([3, 3, 4, 5, 3, 3, 4], greedy(30), poisoned(4), 2),
                           Job([8, 8, 8, 8], greedy(30), poisoned(4), 2)], True),
    "sampling": ([Job([2, 4, 6, 8], greedy(30, temperature=1.0, seed=BAD_SEED), None, 0)], True),
    "prefill": ([Job([4, OUT_OF_VOCAB, 4], greedy(30), None, 0)], True),
    "sampling, once": ([Job([2, 4, 6, 8], greedy(30, temperature=1.0, seed=BAD_SEED), None, 0)], False),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_pass_ends_only_the_request_that_caused_it(fault: str, monkeypatch) -> None:
    """The batch's pass raises because of one row (a draft token the target cannot embed, a NaN
    distribution, a prompt it cannot embed): that row ends with finish reason "error", every other
    row decodes exactly what it decodes alone, K/V included. A fault that does not recur ("once")
    ends nobody and changes no one's tokens: the failed pass committed nothing, not even draws."""
    model = target()
    alone = [job.alone(model) for job in BYSTANDERS]  # before the fault is injected
    failing, ends = FAULTS[fault]
    if fault.startswith("sampling"):
        alone.append(failing[0].alone(model))
        nan_for_seed(monkeypatch, BAD_SEED, (lambda n: n == 5) if fault.endswith("once") else (lambda n: n >= 5))
    jobs = BYSTANDERS[:3] + failing + BYSTANDERS[3:]
    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=len(jobs) - 1))
    assert violations == []
    bystanders = [str(jobs.index(job)) for job in BYSTANDERS]
    for rid, expected in zip(bystanders, alone):
        assert out[rid] == expected and last[rid].finish_reason == "length", f"request {rid} was disturbed"
    for job in failing:
        rid = str(jobs.index(job))
        if not ends:
            assert out[rid] == alone[-1] and last[rid].finish_reason == "length"
            continue
        stats = last[rid].stats  # what its passes before the failing one gave: prefill, 3 steps
        assert last[rid].finish_reason == "error" and last[rid].error is not None
        assert stats.target_passes == (0 if fault == "prefill" else 4) and len(out[rid]) == stats.new_tokens


@pytest.mark.parametrize("extreme", [dict(temperature=1e-38), dict(temperature=1e-46, seed=3),
                                     dict(temperature=0.8, top_p=1e-46), dict(temperature=100.0, top_k=1)])
def test_extreme_sampling_settings_decode_as_greedy(extreme: dict) -> None:
    """Settings that validation accepts and that leave one token possible decode as greedy does,
    in a batch, with sampled drafts (q takes the same transform) and with prompt lookup."""
    model = target()
    jobs = [Job([5, 6, 7, 8, 5, 6, 7], greedy(25, **extreme), draft_random, 3),
            Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(25, **extreme), ngram, 4),
            Job([1, 17, 42, 8, 77, 23], greedy(25, **extreme), None, 0), JOBS[0]]
    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=4), check_kv=False)
    assert violations == []
    for i, job in enumerate(jobs):
        as_greedy = replace(job, params=replace(job.params, temperature=0.0, top_k=0, top_p=1.0, seed=None))
        assert out[str(i)] == as_greedy.alone(model) and last[str(i)].finish_reason == "length"


def test_too_long_prompt_is_refused_without_touching_the_batch() -> None:
    model = target()
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=16))
    engine.add(Request([1, 2, 3], greedy(10), id="ok"))
    with pytest.raises(ContextTooLong, match="16"):
        engine.add(Request(list(range(16)), greedy(10), id="long"))
    out = [t for _ in range(20) for _, ev in engine.step() for t in ev.token_ids]
    assert len(out) == 10


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_sampling_law_inside_full_batches(kind: str) -> None:
    """N_SAMPLES sampled requests through one engine, 8 rows at a time with requests joining as
    others leave: the first tokens follow plain sampling's law (chi-square, as for batch 1)."""
    counts, drafted, accepted = sampled_in_batches(kind)
    assert int(counts.sum()) == N_SAMPLES
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


def sampled_in_batches(kind: str, device: str = "cpu") -> tuple[torch.Tensor, int, int]:
    """N_SAMPLES seeded requests at temperature 1 drafting with `kind` ("draft" or "ngram")
    through one engine (first_tokens_in_batches)."""
    model, draft = tiny16(device), tiny16_draft(device)
    requests, shared = [], Drafter(draft)
    for seed in range(30_000, 30_000 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = (DraftModelProposer(shared, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + SAMPLE_K + 1)
                    if kind == "draft" else NgramProposer(PROMPT16, 4, 1))
        requests.append(Request(PROMPT16, p, frozenset(), proposer, SAMPLE_K, id=str(seed)))
    return first_tokens_in_batches(model, requests)


# -- the draft-length policy -------------------------------------------------------------------------------

def flat_then_steep(knee: int) -> StepCost:
    """A machine whose step time is flat up to `knee` tokens, then grows by one t(1) per token."""
    cost = StepCost()
    for n in range(1, 65):  # (every size timed within STALE steps: each counts as measured)
        cost.observe(n, 1.0 + max(0, n - knee))
    return cost


def test_policy_one_row_verifies_what_pays() -> None:
    cheap, steep = flat_then_steep(64), flat_then_steep(1)
    row = RowDraft(available=8, accept_probs=[0.8] * 8, pinned=False)
    assert choose_draft_lengths([row], cheap) == [8]       # free verification: all of it
    assert choose_draft_lengths([row], steep) == [0]       # each token costs a step: none
    assert choose_draft_lengths([RowDraft(8, [0.0] * 8, False)], cheap) == [0]  # nothing would be accepted


def test_one_slow_step_does_not_turn_drafting_off_for_good() -> None:
    """A size is timed only when the policy picks it: one slow step at t(2) (a new shape's first, a
    hiccup of the host) made every draft look dear, so t(2) was never timed again. Unmeasured for
    STALE steps it counts as unknown (the curve's shape from the fresh sizes), the policy drafts
    again, and the next time replaces the stale one."""
    cost = StepCost()
    cost.seed({1: 1.0, 2: 1.1, 3: 1.2})
    for _ in range(3):
        cost.observe(1, 0.010)
    cost.observe(2, 0.030)  # a slow first step at 2 tokens
    row = RowDraft(available=1, accept_probs=[0.5], pinned=False)
    assert choose_draft_lengths([row], cost) == [0]  # 1.5 tokens for 3x the time: declined
    for _ in range(STALE - 1):
        cost.observe(1, 0.010)  # plain steps only: t(2) is never timed
    assert choose_draft_lengths([row], cost) == [0]  # (still fresh)
    cost.observe(1, 0.010)
    assert cost.estimate(2) == pytest.approx(0.011) and choose_draft_lengths([row], cost) == [1]
    cost.observe(2, 0.0115)
    assert cost.estimate(2) == pytest.approx(0.0115)  # replaced, not smoothed from the stale 0.030
    cost.observe(2, 0.0125)
    assert 0.0115 < cost.estimate(2) < 0.0125  # fresh: smoothed


def test_policy_follows_per_token_estimates() -> None:
    """A proposer sure of its first tokens and unsure of the rest gets only the sure part verified."""
    cost = StepCost()
    for n in range(1, 10):
        cost.observe(n, 1.0 + 0.1 * (n - 1))
    row = RowDraft(6, [0.95, 0.95, 0.9, 0.1, 0.9, 0.9], False)
    assert choose_draft_lengths([row], cost) == [3]  # the 4th token's gain is 0.08: below its cost


def test_policy_drafts_only_for_a_clear_gain() -> None:
    cost = StepCost()
    cost.observe(4, 1.0)
    cost.observe(5, 1.0 + 0.2)
    cost.observe(6, 1.0 + 0.4)
    rows = [RowDraft(2, [0.86] * 2, False)] + [RowDraft(0, None, False)] * 3
    # one draft token: (4 + 0.86) / 1.2 = 4.05 tokens per unit, 1.2% over plain's 4.0: not enough
    assert choose_draft_lengths(rows, cost) == [0, 0, 0, 0]
    rows[0] = RowDraft(2, [0.99] * 2, False)  # (4 + 0.99 + 0.98) / 1.4 = 4.26: 6.6% more
    assert choose_draft_lengths(rows, cost) == [2, 0, 0, 0]


def test_policy_shrinks_with_the_batch_and_prefers_likely_tokens() -> None:
    cost = flat_then_steep(16)
    rows = [RowDraft(8, [0.9] * 8, False), RowDraft(8, [0.3] * 8, False)]
    assert choose_draft_lengths(rows, cost) == [8, 6]       # 16 tokens fit the flat part
    many = [RowDraft(8, [0.9] * 8, False)] * 12 + [RowDraft(8, [0.3] * 8, False)] * 4
    lengths = choose_draft_lengths(many, cost)
    assert sum(lengths) == 0                                # 16 rows already fill the flat part
    assert choose_draft_lengths(many, flat_then_steep(40)) == [2] * 12 + [0] * 4


def test_policy_cap_pinned_rows_and_fixed() -> None:
    cost = flat_then_steep(200)
    rows = [RowDraft(8, [0.9] * 8, False)] * 10
    assert sum(choose_draft_lengths(rows, cost, max_step_tokens=30)) == 20
    pinned = [RowDraft(5, [0.1] * 5, True), RowDraft(3, None, False), RowDraft(4, [0.0] * 4, False)]
    assert choose_draft_lengths(pinned, flat_then_steep(1)) == [5, 3, 0]
    assert choose_draft_lengths(pinned, flat_then_steep(1), policy="fixed") == [5, 3, 4]


def test_policy_never_feeds_a_draft_expected_to_be_rejected() -> None:
    """Measured step times are noisy: here 5 tokens were timed faster than 1. Tokens rated as never
    accepted still go unverified (the rated ones are taken as long as they pay)."""
    cost = StepCost()
    cost.observe(1, 0.135)
    cost.observe(5, 0.120)
    assert choose_draft_lengths([RowDraft(4, [0.0] * 4, False)], cost) == [0]
    assert choose_draft_lengths([RowDraft(4, [0.9, 0.9, 0.0, 0.0], False)], cost) == [2]


def test_step_cost_estimates_from_the_prior_through_measurements() -> None:
    cost = StepCost(prior_slope=0.1)
    assert cost.estimate(11) / cost.estimate(1) == pytest.approx(2.0)
    cost.observe(4, 2.0)
    assert cost.estimate(4) == 2.0
    assert cost.estimate(14) == pytest.approx(2.0 * 2.3 / 1.3)  # the prior's ratio from N=4
    cost.observe(4, 3.0)
    assert cost.estimate(4) == pytest.approx(2.2)                # smoothed
    cost.seed({1: 1.0, 8: 2.0, 16: 4.0})  # a one-row curve: only its shape is used
    assert cost.estimate(4) == pytest.approx(2.2)                 # measured wins
    assert cost.shape(12) == pytest.approx(3.0) and cost.shape(24) == pytest.approx(6.0)
    assert cost.estimate(8) == pytest.approx(2.2 * 2.0 / (1 + 3 / 7))  # the curve's ratio from N=4


def test_a_longer_step_is_never_estimated_cheaper_than_a_measured_shorter_one() -> None:
    """Noise (a 5-token step timed faster than a 1-token one) must not make a draft with next to
    no expected gain look free: the engine of a long-lived model measures many step sizes."""
    cost = StepCost()
    cost.observe(1, 0.100)
    cost.observe(5, 0.090)
    assert cost.estimate(5) == cost.estimate(1) == 0.100 and cost.estimate(3) >= 0.100
    assert choose_draft_lengths([RowDraft(4, [0.01] * 4, False)], cost) == [0]
    cost.observe(9, 0.300)
    assert cost.estimate(9) == 0.300 and cost.estimate(7) > 0.100



def test_step_cost_never_falls_as_steps_grow() -> None:
    """Between two measured sizes t(n) must not fall: scaling from the nearest one gave t(4) = 13
    ms > t(5) = 10 ms from t(1) = 10 ms and t(8) = 12 ms, making 4 more draft tokens look free."""
    cost = StepCost()
    cost.observe(1, 0.010)
    cost.observe(8, 0.012)
    assert all(cost.estimate(n) <= cost.estimate(n + 1) for n in range(1, 20))
    assert cost.estimate(4) <= cost.estimate(8) == 0.012
    rng = random.Random(0)
    for _ in range(50):  # noisy measurements of a rising cost, with and without a measured curve
        cost = StepCost()
        if rng.random() < 0.5:
            cost.seed({1: 1.0, 4: 1.1, 16: 2.0, 64: 6.0})
        for m in rng.sample(range(1, 40), 6):
            cost.observe(m, 0.01 * (1 + 0.05 * m) * rng.uniform(0.8, 1.2))
        assert all(cost.estimate(n) <= cost.estimate(n + 1) for n in range(1, 64))

class Hopeless:
    """Offers k tokens it rates as never accepted; counts how often it drafts and is told."""
    group = EACH

    def __init__(self) -> None:
        self.asked = self.told = 0

    def propose(self, k: int) -> Draft:
        self.asked += 1
        return Draft([1] * k, None, [0.0] * k)

    def commit(self, step: Committed) -> None:
        self.told += 1


class Costly(Hopeless):
    """Drafts as the draft head does: it rests (head.Rest) after the engine declines a draft it ran for."""

    def __init__(self) -> None:
        super().__init__()
        self.rest = Rest()

    def propose(self, k: int) -> Draft:
        if self.rest.resting:
            return NO_DRAFT
        self.rest.ran = True
        return super().propose(k)

    def commit(self, step: Committed) -> None:
        super().commit(step)
        self.rest.after_step(step.verified)


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_costly_proposer_whose_drafts_are_declined_rests(adaptive: bool) -> None:
    """The policy declines every draft of a proposer that expects nothing accepted; after each
    decline a costly proposer rests for 2, 4, 8, 16, 16... steps (it still sees every token).
    Rows that verify whatever is offered (adaptive off) never rest it."""
    model, proposer = target(), Costly()
    events = list(generate_tokens(model, [5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True),
                                  frozenset(), proposer, 4, adaptive=adaptive))
    steps = events[-1].stats.target_passes
    assert proposer.told == steps - 1  # every step but the last commits
    if adaptive:
        assert events[-1].stats.drafted_tokens == 0
        assert proposer.asked == 6  # at steps 1, 4, 9, 18, 35, 52 of 59
    else:
        assert proposer.asked == steps - 1


def test_the_engine_asks_a_proposer_every_step_though_declined() -> None:
    model, proposer = target(), Hopeless()
    events = list(generate_tokens(model, [5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True),
                                  frozenset(), proposer, 4))
    assert events[-1].stats.drafted_tokens == 0  # every draft declined ...
    assert proposer.asked == events[-1].stats.target_passes - 1  # ... and yet asked at every step


def test_the_hybrids_lookup_drafts_while_its_head_rests() -> None:
    """The hybrid asks its lookup every step and its head on the head's own schedule."""
    model, lookup, head = target(), Hopeless(), Costly()
    events = list(generate_tokens(model, [5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True),
                                  frozenset(), HybridProposer(lookup, head), 4))
    steps = events[-1].stats.target_passes
    assert head.asked == 6 and lookup.asked == lookup.told == head.told == steps - 1


def test_rest_doubles_and_only_drafts_the_head_ran_for_end_it() -> None:
    """Declines after a head's drafts double its rest up to MAX_REST; steps that verify drafts it did
    not run for (the hybrid's lookup) neither lengthen nor end the rest; its own verified draft does."""
    rest, schedule = Rest(), []
    for step in range(60):
        ran = not rest.resting
        rest.ran = ran
        schedule.append(ran)
        rest.after_step(verified=0 if step < 40 else 3)  # declined, then always verified
    asks = [i for i, ran in enumerate(schedule) if ran]
    assert asks[:6] == [0, 3, 8, 17, 34, 51] and asks[5] - asks[4] == MAX_REST + 1  # rests 2, 4, 8, 16, 16
    assert schedule[52:] == [True] * 8  # a verified draft it ran for ends the rest
    rest = Rest()
    rest.ran = True
    rest.after_step(verified=0)
    rest.after_step(verified=5)  # a lookup draft verified while the head rests: still resting
    assert rest.resting


def test_proposers_are_told_what_the_pass_they_draft_for_costs() -> None:
    """The pass cost a proposer weighs its draft against is that of the pass the draft goes to,
    with every row it will hold: requests admitted one by one in a step each saw fewer rows (the
    first alone), and a draft model then prefilled every prompt of a busy server's wave and drafted
    for verifications its batch could not pay for."""
    seen: list[tuple[str, int]] = []

    class Told(NgramProposer):
        def __init__(self, name: str, prompt: list[int]) -> None:
            super().__init__(prompt, 4, 1)
            self.name = name

        def commit(self, step: Committed) -> None:
            seen.append((self.name, step.cost.rows))
            super().commit(step)

    # a fixed prefill chunk: the allowance measured from step times would let a busy machine put d's
    # prompt off a step
    engine = Engine(target(), EngineConfig(max_batch=4, prefill_chunk=64))
    for name in "abc":
        engine.add(Request([1, 2, 3, 1, 2], greedy(6), frozenset(), Told(name, [1, 2, 3, 1, 2]), 4, id=name))
    engine.step()  # the three prompts' passes, one after another
    assert seen == []
    engine.step()  # their drafts are asked for: the next pass holds all three
    assert sorted(seen) == [("a", 3), ("b", 3), ("c", 3)]
    engine.add(Request([7, 8, 7], greedy(6), frozenset(), Told("d", [7, 8, 7]), 4, id="d"))
    seen.clear()
    engine.step()  # a, b, c drafted and verified (d waits: the pass holds three); then d's prompt
    assert sorted(seen) == [("a", 3), ("b", 3), ("c", 3)]
    seen.clear()
    engine.step()
    assert sorted(seen) == [("a", 4), ("b", 4), ("c", 4), ("d", 4)]


def test_the_lm_head_scores_only_what_verification_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification stops scoring at the first rejection (engine/scores.py): the head scores fewer
    positions than the passes feed, and every request's tokens stay those of its run alone."""
    model = target()
    head, fed, scored = model.logits, [0], [0]

    def counting(features: torch.Tensor) -> torch.Tensor:
        scored[0] += features[..., 0].numel()
        return head(features)

    def watch(engine: Engine, step: int) -> None:
        plan = engine.scheduler.plan_decode
        if not hasattr(plan, "watched"):
            def planned(*args, **kw):
                p = plan(*args, **kw)
                fed[0] += 0 if p is None else sum(1 + n for n in p.lengths)
                return p
            planned.watched = True
            engine.scheduler.plan_decode = planned

    monkeypatch.setattr(model, "logits", counting)
    out, _, violations = run_batched(model, JOBS, EngineConfig(max_batch=4, policy="fixed"), check_kv=False,
                                     on_step=watch)
    monkeypatch.undo()
    assert violations == []
    for i, job in enumerate(JOBS):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    # the head also scores each prompt's last position; scoring every fed position it would score more
    assert scored[0] < fed[0], (scored[0], fed[0])
