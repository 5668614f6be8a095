"""`draft-tree`: a draft model's likeliest continuations as a tree (EAGLE-2's dynamic tree), grown
level by level in the drafter's batched forwards beside chain rows, its accepted path's K/V moved
into place.

Oracles: plain greedy decoding of each prompt alone (token for token); each member's draft-cache
row against a fresh forward over the tokens it claims (after every commit); the exact law of the
first sampled tokens (chi-square, false failure 1e-6) with a negative control the same test must
reject (another temperature's law); premises counted: trees offered,
several rows per forward, drafts both accepted and rejected, K/V kept from tree nodes.
"""
from __future__ import annotations

from typing import Sequence

import pytest

from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.engine.policy import StepCost
from quickdraft.proposers import draft_tree
from quickdraft.proposers.base import Draft, Proposer, SpecConfig, SpecConfigError
from quickdraft.proposers.draft_cost import ForwardTimes
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams
from support.drafts import Counted, Watched, members, noisy_draft, watch
from support.engine import Job, first_tokens_in_batches, greedy, run_batched, target
from support.laws import (
    ALPHA,
    N_SAMPLES,
    N_TOKENS,
    PROMPT16,
    SAMPLE_K,
    SAMPLE_NEW,
    assert_plain_sampling_law,
    chi_square_p_value,
    plain_law,
)
from support.models import tiny16, tiny16_draft


@pytest.mark.parametrize("widths, policy", [((3,), "fixed"), ((2, 1, 4), "goodput")])
def test_draft_trees_greedy_equal_plain(widths: tuple[int, ...], policy: str) -> None:
    """Ragged prompts and ks, rows joining and leaving, tree rows beside chain rows in one drafter."""
    model = target()
    drafter = Counted(noisy_draft())
    violations: list[str] = []
    log = {"trees": 0, "kept": 0}
    make = members(drafter, widths, violations, log)
    batch = [Job([1, 17, 42, 8, 77, 23], greedy(30), make, 4),
             Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(12), make, 8, join_at=1),
             Job([44, 12, 19], greedy(25), make, 2, join_at=1),
             Job([9, 2, 9, 2, 9, 2, 9, 3, 30, 31, 32], greedy(28), make, 6, join_at=2),
             Job([7, 1, 7], greedy(20, stop_token_ids=(29,)), make, 3, join_at=4),
             Job([3, 4], greedy(22), make, 5, join_at=6)]
    out, last, engine_violations = run_batched(model, batch, EngineConfig(max_batch=3, policy=policy))
    assert engine_violations == [] and violations == []
    for i, job in enumerate(batch):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(model), f"request {i} differs from plain"
    stats = [last[str(i)].stats for i in range(len(batch))]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)
    assert log["trees"] > 5 and max(drafter.rows_per_forward) >= 2
    # whole drafts verified: accepted paths through trees whose nodes were run keep their K/V
    assert policy != "fixed" or log["kept"] > 0


def test_a_draft_tree_of_the_target_itself_commits_many_tokens_per_pass() -> None:
    """The target drafting for itself: its likeliest child is always right, so every pass accepts
    a path (over a random model's flat distributions the k likeliest nodes are a bushy tree of
    depth 2-3: EAGLE-2's rule spends nodes on width where each level is unsure)."""
    model = target()
    violations: list[str] = []
    log = {"trees": 0, "kept": 0}
    job = Job([1, 17, 42, 8, 77, 23], greedy(40), members(Drafter(model), (3,), violations, log), 6)
    out, last, engine_violations = run_batched(model, [job], EngineConfig(max_batch=1, policy="fixed"))
    assert out["0"] == Job(job.prompt, job.params, None, 0).alone(model) and violations == [] == engine_violations
    stats = last["0"].stats
    assert stats.accepted_tokens / stats.target_passes > 1.3 and stats.accepted_at[1] > 0
    assert log["trees"] > 0 and log["kept"] > 0


def first_tokens(drafter: Drafter, seed0: int, width: int) -> tuple:
    requests = []
    for seed in range(seed0, seed0 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = DraftModelProposer(drafter, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + (width + 1) * SAMPLE_K + 1,
                                      width)
        requests.append(Request(PROMPT16, p, frozenset(), proposer, SAMPLE_K, id=str(seed)))
    return first_tokens_in_batches(tiny16(), requests)


def test_sampling_law_through_draft_trees() -> None:
    drafter = Counted(tiny16_draft())
    counts, drafted, accepted = first_tokens(drafter, 60_000, 3)
    assert int(counts.sum()) == N_SAMPLES
    assert max(drafter.rows_per_forward) >= 4  # the premise: tree levels ran for several rows at once
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)
    # negative control: the same draws against plain sampling at another temperature must fail (the
    # verifier's own control, siblings tested without the residual update, is test_tree's: over
    # this model's flat 16-token distributions its bias is too small for 800 draws)
    other = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=0.75), N_TOKENS)
    assert chi_square_p_value(counts, other) < ALPHA


def test_draft_tree_is_a_proposer_with_its_width_in_range() -> None:
    assert SpecConfig(method="draft-tree", options={"draft_width": 2}).proposer_options().draft_width == 2
    with pytest.raises(SpecConfigError, match="draft_width must be in 2..16"):
        SpecConfig(method="draft-tree", options={"draft_width": 1})


def test_a_group_call_failing_in_its_tree_levels_leaves_its_members_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tree levels that fail in a group call, after its catch-up forward and its chain rows' levels
    ran: each member is asked again alone, from where it was (tree levels asked for one member
    work here), and every request emits plain greedy's tokens."""
    model = target()
    drafter = Counted(noisy_draft())
    calls = []
    grow = draft_tree.grow

    def broken_in_groups(self, proposal, *args):
        calls.append([m.width for m in proposal.members])
        if len(proposal.members) > 1:
            raise RuntimeError("tree level failed")
        return grow(self, proposal, *args)
    monkeypatch.setattr(draft_tree, "grow", broken_in_groups)
    make = members(drafter, (1, 1, 3), [], {"trees": 0, "kept": 0})
    batch = [Job([1, 17, 42, 8], greedy(15), make, 4), Job([44, 12, 19], greedy(15), make, 3),
             Job([5, 6, 7], greedy(15), make, 4, join_at=2)]
    out, last, _ = run_batched(model, batch, EngineConfig(max_batch=3, policy="fixed"), check_kv=False)
    for i, job in enumerate(batch):
        assert last[str(i)].finish_reason == "length" and last[str(i)].stats.drafted_tokens > 0
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(model)
    assert [1, 1, 3] in calls  # the premise: group calls failed with chain rows drafted in them


def test_wide_tree_levels_fit_beside_a_long_chain_row() -> None:
    """Every row of a level's span runs as many tokens as the widest tree row: a chain row whose
    capacity sets the cache's length runs its throwaway tokens past its drafts, within the cache."""
    model = target()
    drafter = watch(Counted(noisy_draft()))
    violations: list[str] = []

    def make(prompt: Sequence[int], params: SamplingParams) -> Proposer:
        width = 1 if len(prompt) > 20 else 16
        proposer = Watched(drafter, prompt, params, len(prompt) + params.max_new_tokens + (1 if width == 1 else 137),
                           width)
        proposer.log, proposer.violations = {"trees": 0, "kept": 0}, violations
        return proposer
    long_prompt = [(7 * i) % 50 + 1 for i in range(200)]  # its capacity (221) sets the cache length
    batch = [Job([1, 17, 42], greedy(20), make, 8), Job(long_prompt, greedy(20), make, 8),
             Job([44, 12, 19], greedy(20), make, 8)]
    out, last, engine_violations = run_batched(model, batch, EngineConfig(max_batch=3, policy="fixed"))
    assert engine_violations == [] and violations == []
    for i, job in enumerate(batch):
        assert last[str(i)].finish_reason == "length"
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(model)


def test_tree_levels_run_only_where_they_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tree levels measured at 10 s against a target pass of ~1 s (the engine's prior line) and
    free catch-up forwards: after the first tree level is measured, a row's trees stop at the
    root's children (depth 1); with the fixed policy (lengths that must not depend on timing) the
    same trees grow deep. Outputs are plain's either way."""
    monkeypatch.undo()  # the suite's fixture records draft forwards as free
    observe = ForwardTimes.observe
    monkeypatch.setattr(ForwardTimes, "observe",
                        lambda self, kind, _: observe(self, kind, 10.0 if kind == "tree" else 0.0))
    monkeypatch.setattr(StepCost, "observe", lambda self, n, seconds: None)
    depths = {}
    propose = Drafter.propose
    for policy in ("goodput", "fixed"):
        model = target()
        log = {"trees": 0, "kept": 0}
        job = Job([1, 17, 42, 8, 77, 23], greedy(30), members(Drafter(model), (3,), [], log), 6)
        drafts: list[Draft] = []
        monkeypatch.setattr(Drafter, "propose", lambda self, ms, ks, drafts=drafts: drafts.extend(made := propose(self, ms, ks)) or made)
        out, _, _ = run_batched(model, [job], EngineConfig(max_batch=1, policy=policy), check_kv=False)
        assert out["0"] == Job(job.prompt, job.params, None, 0).alone(model)
        depths[policy] = [max(d.depths(), default=0) for d in drafts[2:]]  # after the first measurement
    assert depths["goodput"] and max(depths["goodput"]) == 1
    assert max(depths["fixed"]) >= 2
