"""Token Recycling (proposers/recycle.py), alone and with prompt lookup (`lookup-recycle`): greedy output equals plain greedy decoding (batch 1 and a
batch with rows joining and leaving, several k, the K/V of every row checked after every step);
sampled output follows plain sampling's law (chi-square, test_spec_exactness); the table is one
object per target, shared by its requests, of fixed size; the commit record's top candidates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

import quickdraft
from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.proposers.base import Committed, ProposerContext, SpecConfig
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.proposers.recycle import (
    EMPTY,
    SHARED_WEIGHT,
    Recycled,
    RecycleProposer,
    make_lookup_recycle,
    make_recycle,
)
from quickdraft.spec.goodput import Acceptance
from quickdraft.spec.sampling import SamplingParams
from support.engine import JOBS, Job, first_tokens_in_batches, run_batched, target
from support.laws import N_SAMPLES, N_TOKENS, PROMPT16, assert_plain_sampling_law
from support.models import V16, tiny16
from support.shared_state import Home, assert_alone_greedy_equals_plain, assert_batched_greedy_equals_plain

VOCAB = 96  # the tiny target's


def recycling(recycled: Recycled, lookup: bool = False):
    def make(prompt: Sequence[int], params: SamplingParams) -> RecycleProposer:
        return RecycleProposer(prompt, recycled, NgramProposer(prompt) if lookup else None, 2)
    return make


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_greedy_equals_plain_alone(k: int, lookup: bool) -> None:
    assert_alone_greedy_equals_plain(recycling(Recycled(VOCAB, 8), lookup), k)


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("policy", ["fixed", "goodput"])
@pytest.mark.parametrize("k", [3, 8])
def test_batched_greedy_equals_plain_with_rows_joining_and_leaving(k: int, policy: str, lookup: bool) -> None:
    assert_batched_greedy_equals_plain(recycling(Recycled(VOCAB, 4), lookup), k, policy)


@pytest.mark.parametrize("lookup", [False, True])
def test_sampled_recycle_trees_through_the_engine_follow_plain_sampling(lookup: bool) -> None:
    """Chi-square on the joint law of the first tokens: false failure probability ALPHA (see
    support.laws.assert_plain_sampling_law); the table is shared by all requests."""
    make = recycling(Recycled(V16, 4), lookup)
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=N_TOKENS + 1, ignore_eos=True)
              for seed in range(60_000, 60_000 + N_SAMPLES)]
    counts, drafted, accepted = first_tokens_in_batches(tiny16(), [
        Request(PROMPT16, p, frozenset(), make(PROMPT16, p), 4, adaptive=False, id=str(p.seed)) for p in params])
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


@pytest.mark.parametrize("method", ["recycle", "lookup-recycle"])
def test_a_second_request_drafts_from_the_first_requests_table(method: str) -> None:
    """One LLM's requests of one scope share one table and its ranks' counts (scoped.py): the second
    run of a prompt accepts more than the first, and the table keeps its shape [V, K] whatever ran;
    the same prompt in another scope drafts from a table of its own, as the first run did."""
    model = target()
    llm = Home(model)
    spec = SpecConfig(method, k=8, adaptive=False, options={"recycle_top": 4})
    job = Job(JOBS[1].prompt, JOBS[1].params, None, 8)
    factory = make_recycle if method == "recycle" else make_lookup_recycle
    made: list[RecycleProposer] = []
    made_in = lambda scope: lambda prompt, params: made.append(
        factory(ProposerContext(list(prompt), params, spec, llm, scope))) or made[-1]
    make = made_in("")
    first = run_batched(model, [replace(job, make=make)], EngineConfig(policy="fixed"))[1]["0"].stats
    tables = llm.state[("per scope", ("recycle", VOCAB, 4))]
    recycled = tables.get("")
    offered = lambda: sum(counts.trials for key, counts in recycled.counts.items() if key[0] == "top")
    learned = offered()
    second = run_batched(model, [replace(job, make=make)], EngineConfig(policy="fixed"))[1]["0"].stats
    assert made[1].recycled is recycled and recycled.table.shape == (VOCAB, 4)
    assert learned > 0 and offered() > learned  # one record of the table's candidates, grown by both requests
    assert second.accepted_tokens > first.accepted_tokens
    assert second.target_passes < first.target_passes
    elsewhere = run_batched(model, [replace(job, make=made_in("another"))], EngineConfig(policy="fixed"))[1]["0"].stats
    assert made[2].recycled is not recycled and made[2].recycled is tables.get("another")
    assert (elsewhere.accepted_tokens, elsewhere.target_passes) == (first.accepted_tokens, first.target_passes)
    for _ in range(3):
        run_batched(model, [replace(j, make=make, k=8) for j in JOBS], EngineConfig(max_batch=4))
    assert list(llm.state) == [("per scope", ("recycle", VOCAB, 4))] and recycled.table.shape == (VOCAB, 4)


def test_commit_records_every_scored_position_rejected_nodes_included() -> None:
    recycled = Recycled(10, 2)
    table = recycled.table
    table[5] = torch.tensor([6, 7])
    table[6] = torch.tensor([8, 9])
    proposer = RecycleProposer([1, 5], recycled)
    draft = proposer.propose(3)  # best-first on the priors 1/3 (rank 0), 1/6 (rank 1): 6, 7, then 6's 8
    assert (draft.tokens, draft.parents) == ([6, 7, 8], [-1, -1, 0])
    tops = {5: [6, 2], 6: [3, 4], 8: [0, 1], 7: [9, 9]}
    # the target kept 6, rejected 8, said 3: positions scored are the root (5), then nodes 6, 7, 8
    proposer.commit(Committed([6, 3], 1, 3, torch.empty(2, 0), lambda n: [tops[t][:n] for t in (5, 6, 7, 8)]))
    assert table[5].tolist() == [6, 2] and table[6].tolist() == [3, 4]
    assert table[8].tolist() == [0, 1] and table[7].tolist() == [9, 9]  # recycled
    assert proposer.text[-1] == 3 and table[0].tolist() == [EMPTY, EMPTY]
    assert proposer.propose(2).tokens == []  # row 3 was never filled
    # 6 was rank 0 under 5; 3 was not in 6's row: right 1 of 2 here, and server-wide (the prior 1 of 3) 2 of 5
    assert proposer.counts[("top", 0, 0)] == Acceptance(1, 2) and recycled.counts[("top", 0, 0)] == Acceptance(2, 5)
    assert proposer.rate(("top", 0, 0)) == pytest.approx((1 + SHARED_WEIGHT * 2 / 5) / (2 + SHARED_WEIGHT))
    assert RecycleProposer([3], recycled).rate(("top", 0, 0)) == pytest.approx(2 / 5)  # a new request: the server's


def test_followers_are_distinct_longest_match_first_latest_first() -> None:
    #                  0  1  2  3  4  5  6  7  8  9
    lookup = NgramProposer([1, 2, 3, 9, 2, 4, 1, 2, 5, 1], max_n=2, min_n=1)
    assert lookup.followers([7, 1, 2], 3) == [(2, 5), (2, 3), (1, 4)]  # "1 2" went on 5 then 3; "2" also 4
    assert lookup.followers([1, 2], 1) == [(2, 5)]
    assert lookup.followers([8, 2], 2) == [(1, 5), (1, 4)]  # no "8 2": the latest "2"s first
    assert lookup.followers([8], 2) == []


def test_lookup_recycle_tries_the_text_first_then_the_table_along_its_own_paths() -> None:
    """A node's children: what followed its text earlier in the request (the path included), then
    the table's row for its token without repeats."""
    recycled = Recycled(10, 2)
    recycled.table[3] = torch.tensor([4, 8])
    recycled.table[4] = torch.tensor([7, 6])
    proposer = RecycleProposer([1, 2, 3, 5, 6, 2, 3], recycled, NgramProposer([1, 2, 3, 5, 6, 2, 3], 3, 1), 1)
    assert proposer.candidates([6, 2, 3]) == [(5, ("lookup", 2, 0)), (4, ("top", 0, 1)), (8, ("top", 1, 1))]
    assert proposer.candidates([2, 3, 4]) == [(7, ("top", 0, 0)), (6, ("top", 1, 0))]  # "4" never occurred
    assert proposer.candidates([3, 5, 6]) == [(2, ("lookup", 3, 0))]  # row 6 never filled
    draft = proposer.propose(4)
    # 5 (lookup, prior 1/3) then its lookup follower 6; 4 (second candidate, 1/6); 8 (third, 1/9)
    assert draft.tokens[:2] == [5, 4] and draft.parents[:2] == [-1, -1]
    assert set(zip(draft.tokens, draft.parents)) >= {(6, 0)}
    # the target says 5 then 6: the lookup's count for a 2-token match grows, the table's rank 0 not
    proposer.commit(Committed([5, 6], 1, 4, torch.empty(2, 0), None))
    assert proposer.rate(("lookup", 2, 0)) == pytest.approx((1 + SHARED_WEIGHT * 2 / 4) / (1 + SHARED_WEIGHT))
    assert recycled.counts[("top", 0, 1)] == Acceptance(0.5, 4.0) and proposer.text == [2, 3, 5, 6][-3:]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["recycle", "lookup-recycle", "suffix"])
def test_greedy_equals_plain_on_the_default_model(method: str) -> None:
    """SmolLM2: each prompt twice, the second time with the shared table / corpus the first left."""
    from support.real_model import SPEC_PROMPTS, chat
    llm = quickdraft.load()
    params = SamplingParams(max_new_tokens=64)
    accepted = []
    for _ in range(2):
        accepted.append(0)
        for prompt in SPEC_PROMPTS:
            plain = llm.generate(messages=chat(prompt), params=params, spec=SpecConfig(method="none"))
            spec = llm.generate(messages=chat(prompt), params=params, spec=SpecConfig(method, k=8, adaptive=False))
            assert spec.token_ids == plain.token_ids, prompt
            accepted[-1] += spec.stats.accepted_tokens
    assert 0 < accepted[0] < accepted[1]
