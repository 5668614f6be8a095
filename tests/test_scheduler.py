"""The scheduler (engine/scheduler.py) without a model: requests are ids and prompt lengths, passes
are numbers of tokens and seconds. Admission order, the prefill allowance, draft lengths and the
split into batch-invariant passes, what verification costs, and how timing feeds back.

Oracles: the rules in engine/prefill.py and engine/policy.py written out for small cases, and the
engine's own use of them (tests/test_batch_engine.py, tests/test_prefix_cache.py run it end to end).
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from types import SimpleNamespace

import pytest

from quickdraft.engine.policy import RowDraft, StepCost, choose_draft_lengths
from quickdraft.engine.prefill import MIN_CHUNK, PASSED_OVER, RETIME
from quickdraft.engine.scheduler import DecodePlan, EngineConfig, Pass, Scheduler
from quickdraft.engine.startup import COST_Q
from quickdraft.spec.draft_contract import Draft


def request(name: str, n: int) -> SimpleNamespace:
    """What the scheduler reads of a request: its id and its prompt."""
    return SimpleNamespace(id=name, prompt_ids=list(range(n)))


def scheduler(invariant_rows: int | None = 64, ragged: bool = True, **config) -> Scheduler:
    cost = StepCost()
    cost.observe(1, 0.010)
    return Scheduler(EngineConfig(**config), cost, invariant_rows, ragged)


def test_it_imports_without_the_model_or_the_kernels() -> None:
    code = ("import sys, quickdraft.engine.scheduler; "
            "print(sorted(m for m in sys.modules if m.startswith(('quickdraft.model', 'quickdraft.kernels', "
            "'quickdraft.kv'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_shortest_remaining_prefill_goes_first_and_none_is_passed_over_forever() -> None:
    s = scheduler(max_batch=8)
    for name, n in [("long", 900), ("cached", 1000), ("short", 50)]:
        s.add(request(name, n))
    cached = {"long": 0, "cached": 980, "short": 0}  # tokens of each prompt the prefix cache holds
    order = [s.next_admitted(lambda r: cached[r.id]).id for _ in range(3)]
    assert order == ["cached", "short", "long"] and s.passed == {}
    # a long prompt behind a stream of short ones goes first once passed over PASSED_OVER times
    s.add(request("long", 900))
    taken = []
    for i in range(PASSED_OVER + 1):
        s.add(request(f"s{i}", 10))
        taken.append(s.next_admitted(lambda r: 0).id)
    assert taken == [f"s{i}" for i in range(PASSED_OVER)] + ["long"]


def test_a_cancelled_request_leaves_the_queue_and_its_count() -> None:
    s = scheduler(max_batch=1)
    s.add(request("a", 30))
    s.add(request("b", 10))
    assert s.next_admitted(lambda r: 0).id == "b" and s.passed == {"a": 1}
    assert s.cancel("a") and not s.cancel("a") and s.passed == {} and s.waiting == []
    s.add(request("c", 5))
    assert s.admits(0) and not s.admits(1)  # max_batch rows held: no admission


def room(s: Scheduler, decoding: int, riding: bool = False) -> int | None:
    """The prefill room of a fresh step."""
    s.begin_step()
    return s.prefill_room(decoding, riding)


def test_the_allowance_is_the_chunk_asked_for_or_what_stalls_the_rows_little() -> None:
    assert room(scheduler(prefill_chunk=48), 3, riding=True) == 48
    s = scheduler()
    assert room(s, 0) is None  # no row decodes: whole prompts
    assert room(s, 1, riding=True) == MIN_CHUNK  # no prefill measured yet
    s.prefilled(100, 0.010)  # 100 tokens cost one decode step: a chunk may grow to twice the last
    assert room(s, 1, riding=True) == room(s, 1) == 75  # STALL of a step's worth, 0.75 x 100


def test_a_steps_room_is_spent_by_what_it_prefills_and_closed_by_a_chunk_that_rode() -> None:
    s = scheduler()
    s.prefilled(100, 0.010)
    assert room(s, 1, riding=True) == 75
    s.spend(30)  # a prompt's last 30 tokens rode: the rest of the room goes to the next prompt
    assert s.prefill_room(2) == 45
    s.close()  # a chunk rode and its prompt goes on (or the prompt failed): nothing more this step
    assert s.prefill_room(2) == 0 and room(s, 2) > 0
    assert room(s, 0) is None  # no row decodes: no limit, while none does
    s.spend(400)  # a whole prompt, which then decodes: the next prompt gets a chunk
    s.prefilled(400, 0.040)
    assert s.prefill_room(1) == 75 and s.prefill_room(1) == 75  # (set once, then spent only)
    s.spend(75)
    assert s.prefill_room(1) == 0


def test_rows_untimed_for_retime_steps_get_a_step_of_their_own() -> None:
    s = scheduler()
    s.prefilled(100, 0.010)
    assert room(s, 2, riding=True) > 0  # first asked: their clock starts
    for _ in range(RETIME - 1):
        s.begin_step()
    assert room(s, 2, riding=True) == 0 and room(s, 2) > 0  # this step times them alone (a chunk rides in none)
    s.decoded(2, 2, 0.5)  # (an engine's first decode pass, cold: not timed)
    assert s.cost.step_s == {1: 0.010}
    s.decoded(2, 2, 0.030)  # and the time replaces the estimate outright
    assert s.cost.estimate(2) == pytest.approx(0.030) and room(s, 2, riding=True) > 0
    s.decoded(2, 2, 0.060)  # timed again soon: smoothed, not replaced
    assert 0.030 < s.cost.estimate(2) < 0.060


def test_a_pass_past_the_invariant_rows_splits_and_a_chunk_rides_in_the_room_left() -> None:
    s = scheduler(invariant_rows=16, policy="fixed")
    six = RowDraft(5, None, True)
    assert s.plan_decode([six, six]) == DecodePlan((5, 5), (6, 6), 0)
    assert s.plan_decode([six, six, six]) is None  # 18 tokens: halves instead
    assert s.plan_decode([RowDraft(20, None, True)]) == DecodePlan((20,), (21,), 0)  # one row is never split
    assert s.plan_decode([six], ride=(100, 40)) == DecodePlan((5,), (6,), 10)  # 16 - 6 tokens of room
    assert s.plan_decode([six], ride=(4, 40)) == DecodePlan((5,), (6,), 4)  # the prompt's last 4
    padded = scheduler(invariant_rows=16, ragged=False, policy="fixed")
    assert padded.plan_decode([six, RowDraft(0, None, True), RowDraft(0, None, True)]) is None  # 3 x 6 fed
    # a step's passes: one where the rows fit, else halves planned apart, the chunk riding in neither
    assert s.plan_step([six, six], ride=(100, 40)) == (Pass(0, 2, DecodePlan((5, 5), (6, 6), 4)),)
    assert s.plan_step([six, six, six], ride=(100, 40)) == (Pass(0, 1, DecodePlan((5,), (6,), 0)),
                                                            Pass(1, 3, DecodePlan((5, 5), (6, 6), 0)))
    assert s.plan_step([six] * 5) == (Pass(0, 2, DecodePlan((5, 5), (6, 6))), Pass(2, 3, DecodePlan((5,), (6,))),
                                      Pass(3, 5, DecodePlan((5, 5), (6, 6))))


def test_the_head_scores_first_what_the_walk_likely_reads_where_passes_are_ragged() -> None:
    doubtful, sure = RowDraft(8, [0.3] * 8, True), RowDraft(8, [1.0] * 8, True)
    plan = scheduler(policy="fixed").plan_decode([doubtful, sure, RowDraft(8, None, True)])
    assert plan.lengths == (8, 8, 8)
    assert 1 <= plan.scored[0] < 9 and plan.scored[1:] == (9, 9)  # no estimate: every position
    # padded passes run the head where a host sync costs more than the rows it saves: all of them
    assert scheduler(policy="fixed", ragged=False).plan_decode([doubtful]).scored == (9,)
    # a tree (its walk leaves the first positions by any branch), or a proposer reading every
    # position's top tokens (recycle): scored whole
    chain = Draft([1, 2, 3, 4], accept_probs=[0.3] * 4)
    tree = Draft([1, 2, 3, 4], accept_probs=[0.3] * 4, parents=[-1, -1, 0, 1])
    reads_top = Draft([1, 2, 3, 4], accept_probs=[0.3] * 4, scored_whole=True)
    assert [RowDraft.of(d, True).as_walked for d in (chain, tree, reads_top)] == [True, False, False]
    assert scheduler(policy="fixed").plan_decode([RowDraft.of(d, True) for d in (chain, tree, reads_top)]).scored[1:] \
        == (5, 5)


def test_the_goodput_policy_drafts_where_verifying_is_cheap() -> None:
    s = scheduler(invariant_rows=None)
    for n, t in [(1, 0.010), (2, 0.0105), (4, 0.011), (8, 0.012)]:
        s.cost.observe(n, t)
    sure, unsure = RowDraft(4, [0.9] * 4, False), RowDraft(4, [0.01] * 4, False)
    assert s.plan_decode([sure]).lengths == (4,)
    assert s.plan_decode([unsure]).lengths == (0,)
    cost = s.pass_cost([4])
    assert cost.seconds == pytest.approx(0.010) and cost.per_token > 0
    assert scheduler(policy="fixed").pass_cost([4]) is None  # drafts then never depend on timing


def test_a_riding_chunk_is_charged_what_it_added_to_the_step() -> None:
    s = scheduler()
    assert s.ride_share(1, 0.025) == pytest.approx(0.015)
    assert s.ride_share(1, 0.005) == 0.0  # a pass timed faster than the estimate: nothing, never less


# t(q) in ms for q = 1..17 of Qwen3-30B-A3B's shape (docs/notes/moe.md: 16 layers, Q4_K_M, Intel Xeon)
MOE_CURVE = [62.0, 73.4, 83.4, 98.6, 100.0, 109.2, 117.6, 146.1, 169.5, 186.4, 196.4, 200.0, 206.2, 220.4,
             234.9, 274.1, 304.3]


def verified(curve: dict[int, float], accept: float) -> int:
    """Draft tokens the goodput policy verifies of 16 offered, each accepted with `accept`, priced
    from the forward-cost curve `curve` (q -> seconds)."""
    cost = StepCost()
    cost.seed(curve)
    return choose_draft_lengths([RowDraft(16, [accept] * 16, False)], cost)[0]


def curve_at(times: list[float], qs: Iterable[int]) -> dict[int, float]:
    return {q: times[q - 1] for q in qs}


DENSE = [1 + 0.9 * (q - 1) / 8 for q in range(1, 18)]  # t(9)/t(1) = 1.9, as the dense models on this CPU


@pytest.mark.parametrize("qs", [range(1, 18), (1, *COST_Q[:4])], ids=["every q", "the start-up points"])
def test_drafts_shrink_where_a_mixture_of_experts_makes_verification_dearer(qs) -> None:
    """A pass of q tokens reads up to q x top-k experts, so t(q)/t(1) rises faster than a dense
    model's: priced from that measured curve (every q, or the points measured at start-up), the
    policy verifies shorter drafts at the same acceptance (and no longer where drafts are short
    anyway)."""
    assert 0 < verified(curve_at(MOE_CURVE, qs), 0.5) <= verified(curve_at(DENSE, qs), 0.5)
    assert verified(curve_at(MOE_CURVE, qs), 0.9) < verified(curve_at(DENSE, qs), 0.9)


# t(q) in ms, q = 1..17, of gpt-oss-20b's shape as `bench plain` measured it (docs/notes/moe.md: 12
# layers, MXFP4 experts, Intel Xeon): t(5) < t(4), t(9) < t(8) and t(13) < t(12), noise of a loaded host
GPT_OSS_CURVE = [240.8, 314.4, 389.0, 426.4, 291.3, 312.5, 372.3, 473.9, 402.8, 493.7, 529.8, 613.0, 553.6, 569.5,
                 656.6, 686.7, 742.4]


@pytest.mark.parametrize("curve, dip", [
    (curve_at(GPT_OSS_CURVE, range(1, 18)), (4, 5)),
    ({1: 1.0, 2: 1.3, 4: 1.8, 8: 1.6, 16: 2.9}, (4, 8)),  # a dip at the points start-up measures
], ids=["every q", "the start-up points"])
def test_a_dip_in_the_measured_curve_does_not_price_a_longer_pass_below_a_shorter_one(
        curve: dict[int, float], dip: tuple[int, int]) -> None:
    cost = StepCost()
    cost.seed(curve)
    shape = [cost.shape(q) for q in range(1, 30)]
    shorter, longer = dip
    assert curve[longer] < curve[shorter]  # the premise
    assert shape == sorted(shape) and cost.shape(longer) == cost.shape(shorter) == curve[shorter]


def test_gpt_oss_curves_dip_no_longer_draws_long_drafts_where_drafts_are_short() -> None:
    """Taken as measured, t(5) < t(4) made a 4-token draft look cheaper than 1 at acceptance 0.5."""
    assert verified(curve_at(GPT_OSS_CURVE, range(1, 18)), 0.5) <= verified(curve_at(DENSE, range(1, 18)), 0.5)
