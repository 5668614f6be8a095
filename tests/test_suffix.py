"""Suffix decoding (proposers/suffix.py): greedy output equals plain greedy decoding (batch 1 and a
batch with rows joining and leaving, several k, the K/V of every row checked after every step);
sampled output follows plain sampling's law (chi-square, test_spec_exactness); the corpus of
responses is one per target, shared by its requests, and stays within its token budget.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.proposers.base import ProposerContext, SpecConfig
from quickdraft.proposers.scoped import PerScope
from quickdraft.proposers.suffix import Corpus, SuffixProposer, make_suffix
from quickdraft.spec.sampling import SamplingParams
from support.engine import JOBS, Job, first_tokens_in_batches, run_batched, target
from support.laws import N_SAMPLES, N_TOKENS, PROMPT16, assert_plain_sampling_law
from support.models import tiny16
from support.shared_state import (
    Home,
    assert_alone_greedy_equals_plain,
    assert_batched_greedy_equals_plain,
)


def suffixing(corpus: Corpus, branches: int = 4):
    def make(prompt: Sequence[int], params: SamplingParams) -> SuffixProposer:
        return SuffixProposer(prompt, corpus, 4, 1, branches)
    return make


@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_greedy_equals_plain_alone(k: int) -> None:
    assert_alone_greedy_equals_plain(suffixing(Corpus(4096, 64, 4, 1)), k)


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
@pytest.mark.parametrize("k", [3, 8])
def test_batched_greedy_equals_plain_with_rows_joining_and_leaving(k: int, policy: str) -> None:
    assert_batched_greedy_equals_plain(suffixing(Corpus(4096, 64, 4, 1)), k, policy)


def test_sampled_suffix_trees_through_the_engine_follow_plain_sampling() -> None:
    """Chi-square on the joint law of the first tokens: false failure probability ALPHA (see
    support.laws.assert_plain_sampling_law); the corpus is shared by all requests."""
    corpus = Corpus(4096, 64, 4, 1)
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=N_TOKENS + 1, ignore_eos=True)
              for seed in range(70_000, 70_000 + N_SAMPLES)]
    counts, drafted, accepted = first_tokens_in_batches(tiny16(), [
        Request(PROMPT16, p, frozenset(), SuffixProposer(PROMPT16, corpus, 4, 1, 4), 4, adaptive=False,
                id=str(p.seed)) for p in params])
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


def test_a_second_request_drafts_from_the_first_requests_response() -> None:
    """One target's requests of one scope share one corpus (scoped.py): a prompt run again is drafted
    from the first run's response, so it takes fewer passes, but not in another scope, where it runs
    as the first did; the corpus keeps to its budget."""
    model = target()
    home = Home(model)
    spec = SpecConfig("suffix", k=8, adaptive=False, options={"suffix_tokens": 100, "suffix_responses": 3})
    made_in = lambda scope: lambda prompt, params: make_suffix(ProposerContext(list(prompt), params, spec, home, scope))
    make = made_in("")
    job = Job([1, 17, 42, 8, 77, 23], SamplingParams(max_new_tokens=40, ignore_eos=True), make, 8)
    first = run_batched(model, [job], EngineConfig(policy="fixed"))[1]["0"].stats
    second = run_batched(model, [job], EngineConfig(policy="fixed"))[1]["0"].stats
    elsewhere = run_batched(model, [replace(job, make=made_in("another"))], EngineConfig(policy="fixed"))[1]["0"].stats
    assert second.accepted_tokens > first.accepted_tokens
    assert second.target_passes < first.target_passes
    assert (elsewhere.accepted_tokens, elsewhere.target_passes) == (first.accepted_tokens, first.target_passes)
    (scopes,) = home.state.values()
    corpus = scopes.get("")
    for _ in range(3):
        run_batched(model, [replace(j, make=make, k=8) for j in JOBS], EngineConfig(max_batch=4))
        assert corpus.size <= 100 and len(corpus.docs) <= 3
        assert corpus.size == sum(map(len, corpus.docs.values()))
        assert sum(len(ends) for docs in corpus.index.values() for ends in docs.values()) <= 4 * corpus.size
    assert list(home.state) == [("per scope", ("suffix", 100, 3, 4, 1))] and list(scopes.states) == ["another", ""]


def test_corpus_finds_the_longest_match_newest_first_and_evicts_the_oldest() -> None:
    corpus = Corpus(12, 10, 3, 1)
    a, b, c = corpus.open(), corpus.open(), corpus.open()
    corpus.extend(a, [1, 2, 3, 4, 5])
    corpus.extend(b, [2, 3, 9, 1, 2, 3, 6])
    assert corpus.continuations([0, 1, 2, 3], 2, 4, skip=c) == [(("corpus", 3, 0), [6]), (("corpus", 3, 1), [4, 5])]
    assert corpus.continuations([7, 2, 3], 2, 4, skip=b) == [(("corpus", 2, 0), [4, 5])]
    corpus.extend(c, [8, 8])  # 14 tokens > 12: the oldest response leaves, with its index entries
    assert list(corpus.docs) == [b, c] and corpus.size == 9
    assert corpus.continuations([1, 2, 3], 2, 4, skip=c) == [(("corpus", 3, 0), [6])]
    assert all(a not in docs for docs in corpus.index.values())
    corpus.extend(a, [1, 2])  # an evicted response takes nothing more
    assert corpus.size == 9


def test_scopes_keep_the_most_recently_used_tables() -> None:
    """Scopes come from clients, so their tables are bounded: the oldest goes, a returning scope starts afresh."""
    tables = PerScope(lambda: [], limit=2)
    a, b = tables.get("a"), tables.get("b")
    assert tables.get("a") is a and tables.get("b") is b and a is not b
    tables.get("c")  # "a" was used least recently
    assert list(tables.states) == ["b", "c"] and tables.get("a") is not a
