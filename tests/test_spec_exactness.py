"""Speculative decoding is exact: the engine with a proposer emits what plain decoding emits.

Oracles: plain greedy decoding through the same engine (token for token); the exact law of the
first sampled tokens under plain sampling, computed from the model's probabilities over every
prefix (chi-square, with a negative control the test must reject); K/V recomputed from scratch
for what a cache claims to hold; and for stop conditions, plain decoding with the same stop id.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

import pytest
import torch

from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.engine.loop import generate_tokens
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, Committed, Draft, Proposer
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.engine import Checked, draft_state
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
from support.models import KV_TOL, V16, kv_mismatch, tiny, tiny16, tiny16_draft

MAX_NEW = 40
KS = [1, 2, 4, 8]
# name[@GGUF block type[+int8]]: quantized models must be as exact (hidden 256 for the K-quants'
# superblocks), with int16 activations or int8 ones
MODELS = ["llama-gqa-untied", "qwen2-qkv-bias", "llama-gqa-untied@Q4_1", "qwen2-qkv-bias@Q8_0",
          "llama-gqa-untied@Q4_K", "qwen2-qkv-bias@Q6_K", "llama-gqa-untied@Q4_K+int8", "qwen2-qkv-bias@Q6_K+int8"]
PROMPT = [1, 17, 42, 8, 77, 23, 5, 61, 30, 12]          # varied: little for n-grams to find
PROMPT_REPEAT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]  # repeated phrases


def greedy(n: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


# -- running the engine with checks after every event ------------------------------------------------------

@dataclass
class Run:
    ids: list[int]
    events: list[TokenEvent]
    cache_lengths: list[int]       # the target cache's length after each event
    kv_diffs: list[float] = field(default_factory=list)  # target cache vs fresh forward, per event

    @property
    def stats(self) -> GenerationStats:
        return self.events[-1].stats

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish_reason


def run(model: Transformer, prompt: Sequence[int], params: SamplingParams, proposer: Proposer | None = None,
        k: int = 0, check_kv: bool = True) -> Run:
    budget = min(params.max_new_tokens, model.config.max_position_embeddings - len(prompt))
    cache = model.new_cache(1, len(prompt) + budget)
    out = Run([], [], [])
    # adaptive=False: every offered draft token is verified, so what the tests exercise does not
    # depend on this machine's step timings (the policy's trimming is tested in test_batch_engine)
    for event in generate_tokens(model, prompt, params, frozenset(), proposer, k, cache=cache, adaptive=False):
        out.ids += event.token_ids
        out.events.append(event)
        out.cache_lengths.append(cache.lengths[0])
        if check_kv:
            out.kv_diffs.append(kv_mismatch(model, cache, (list(prompt) + out.ids)[:cache.lengths[0]]))
    return out


def cache_violations(r: Run, n_prompt: int) -> list[str]:
    """After each event the target cache holds the prompt and every emitted token but the newest;
    after a stop it holds the prompt and every emitted token (the stop token is the newest, and
    nothing after it), as plain decoding leaves it."""
    bad, new = [], 0
    for i, (event, length) in enumerate(zip(r.events, r.cache_lengths)):
        new += len(event.token_ids)
        expected = n_prompt + new - (0 if event.finish_reason == "stop" else 1)
        if length != expected:
            bad.append(f"event {i} ({event.finish_reason}): cache length {length}, expected {expected}")
    return bad


def check_common(r: Run, n_prompt: int, params: SamplingParams) -> None:
    assert cache_violations(r, n_prompt) == []
    assert max(r.kv_diffs, default=0.0) <= KV_TOL, "the target cache holds K/V of tokens not committed"
    assert r.stats.new_tokens == len(r.ids)
    assert [e.finish_reason for e in r.events[:-1]] == [None] * (len(r.events) - 1)


# -- scenarios -------------------------------------------------------------------------------------------

def draft_proposer(draft: Transformer, prompt: Sequence[int], params: SamplingParams, k: int) -> Checked:
    capacity = len(prompt) + params.max_new_tokens + k + 1  # as the registry's factory sizes it
    return Checked(DraftModelProposer(Drafter(draft), prompt, params, capacity), prompt)


SCENARIOS = {
    # name: (target, proposer factory(model_name, prompt, params, k), prompt)
    "draft-same": (lambda m: tiny(m), lambda m, pr, pa, k: draft_proposer(tiny(m), pr, pa, k), PROMPT),
    "draft-random": (lambda m: tiny(m), lambda m, pr, pa, k: draft_proposer(tiny(m, seed=1), pr, pa, k), PROMPT),
    # llama at init 0.02 loops with variations, qwen2 at 0.2 half-repeats: both mix hits and misses
    # (random K-quant blocks at 0.02 repeat one token: they keep 0.2).
    "ngram": (lambda m: tiny(m, init=0.02 if m.startswith("llama") and "_K" not in m else 0.2),
              lambda m, pr, pa, k: Checked(NgramProposer(pr, 4, 1), pr), PROMPT_REPEAT),
    "ngram-tree": (lambda m: tiny(m, init=0.02 if m.startswith("llama") and "_K" not in m else 0.2),
                   lambda m, pr, pa, k: Checked(NgramProposer(pr, 4, 1, branches=4), pr), PROMPT_REPEAT),
}


@functools.lru_cache(maxsize=None)
def plain_greedy(scenario: str, model_name: str, n: int = MAX_NEW) -> tuple[int, ...]:
    target, _, prompt = SCENARIOS[scenario]
    r = run(target(model_name), prompt, greedy(n))
    check_common(r, len(prompt), greedy(n))
    assert r.stats.target_passes == n and r.stats.drafted_tokens == 0
    return tuple(r.ids)


def spec_run(scenario: str, model_name: str, k: int, params: SamplingParams | None = None) -> tuple[Run, Checked]:
    target, make, prompt = SCENARIOS[scenario]
    params = params or greedy()
    proposer = make(model_name, prompt, params, k)
    return run(target(model_name), prompt, params, proposer, k), proposer


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_speculative_equals_plain(scenario: str, model_name: str, k: int) -> None:
    ref = plain_greedy(scenario, model_name)
    assert len(set(ref)) > 3, "a model repeating one token would prove little"
    r, proposer = spec_run(scenario, model_name, k)
    assert r.ids == list(ref)
    assert r.finish == "length"
    check_common(r, len(SCENARIOS[scenario][2]), greedy())
    assert all(len(p) <= k for p in proposer.proposals)
    assert r.stats.drafted_tokens > 0
    if scenario == "draft-random":  # the premise: a draft of other weights is rarely right
        assert r.stats.acceptance_rate < 0.3


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", MODELS)
def test_draft_equal_to_target_accepts_everything(model_name: str, k: int) -> None:
    r, _ = spec_run("draft-same", model_name, k)
    s = r.stats
    assert r.ids == list(plain_greedy("draft-same", model_name))
    # Prefill gives the first token; every later pass commits k accepted drafts and a bonus token,
    # except the last, whose draft is cut to the remaining budget.
    assert s.acceptance_rate == 1.0, f"acceptance {s.acceptance_rate:.3f} with draft == target"
    assert s.target_passes == 1 + math.ceil((MAX_NEW - 1) / (k + 1))
    assert [len(e.token_ids) for e in r.events[1:-1]] == [k + 1] * (len(r.events) - 2)
    assert s.tokens_per_pass == pytest.approx(MAX_NEW / s.target_passes)
    assert s.drafted_tokens == s.accepted_tokens == MAX_NEW - s.target_passes


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("scenario", ["draft-same", "draft-random"])
def test_draft_proposer_cache_follows_the_committed_tokens(scenario: str, k: int) -> None:
    """After each commit the draft's cache holds K/V of a prefix of the committed tokens (never the
    newest one, never a rejected draft), and that K/V is what a fresh forward computes."""
    r, proposer = spec_run(scenario, "llama-gqa-untied", k)
    assert r.ids == list(plain_greedy(scenario, "llama-gqa-untied"))
    assert proposer.violations == []
    inner = proposer.inner
    # At each event the proposer has also proposed: its cache may hold its pending drafts but
    # covers the committed tokens it knows of.
    assert draft_state(inner).cached <= len(inner.tokens) and inner.cache.lengths[0] <= len(inner.tokens) + k - 1


def test_ngram_acceptance_is_mixed() -> None:
    rates = {(m, k): spec_run("ngram", m, k)[0].stats.acceptance_rate for m in MODELS for k in KS}
    assert any(0 < rate < 1 for rate in rates.values()), rates


# -- stop conditions inside an accepted run ---------------------------------------------------------------

class Replay:
    """A proposer that drafts the plain greedy continuation: every draft is accepted, whatever
    the draft-model proposer does (isolates the engine's handling of long accepted runs)."""
    group = EACH

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self.n_prompt, self.seq, self.continuation = len(prompt), list(prompt), list(continuation)

    def propose(self, k: int) -> Draft:
        done = len(self.seq) - self.n_prompt
        return Draft(self.continuation[done:done + k], None)

    def commit(self, step: Committed) -> None:
        self.seq += step.tokens


STOP_K = 8
MODEL = "llama-gqa-untied"


def stop_proposer(kind: str, params: SamplingParams) -> Proposer:
    if kind == "replay":
        return Replay(PROMPT, plain_greedy("draft-same", MODEL))
    return draft_proposer(tiny(MODEL), PROMPT, params, STOP_K)


def stop_index(ref: Sequence[int], k: int) -> int:
    """An index j whose token first occurs there and that an all-accepting run with k drafts emits
    as an accepted draft with more accepted drafts after it (steps after prefill emit 1..k+1,
    k+2..2k+2, ...: j - 1 mod (k+1) in 0..k-2)."""
    return next(j for j in range(2, len(ref)) if ref[j] not in ref[:j] and (j - 1) % (k + 1) in range(1, k - 1))


@pytest.mark.parametrize("kind", ["replay", "draft-same"])
def test_stop_token_inside_an_accepted_run(kind: str) -> None:
    ref = plain_greedy("draft-same", MODEL)
    j = stop_index(ref, STOP_K)
    params = greedy(stop_token_ids=(ref[j],))
    plain = run(tiny(MODEL), PROMPT, params)
    assert (plain.ids, plain.finish) == (list(ref[:j]), "stop")
    r = run(tiny(MODEL), PROMPT, params, stop_proposer(kind, params), STOP_K)
    assert (r.ids, r.finish) == (plain.ids, "stop")
    assert r.stats.new_tokens == j
    # The premise: the stop token was an accepted draft with accepted drafts after it, which the
    # engine dropped (the last pass accepted more tokens than it emitted).
    before = r.events[-2].stats
    accepted_last = r.stats.accepted_tokens - before.accepted_tokens
    assert j - before.new_tokens < accepted_last, \
        f"stop at offset {j - before.new_tokens} of a step that accepted {accepted_last} drafts"
    assert r.events[-1].token_ids == list(ref[before.new_tokens:j])


def test_cache_after_a_stop_inside_an_accepted_run() -> None:
    """After the stop, the target cache holds the prompt and the emitted tokens, as after plain
    decoding with the same stop id: not the accepted drafts that followed the stop token."""
    ref = plain_greedy("draft-same", MODEL)
    j = stop_index(ref, STOP_K)
    params = greedy(stop_token_ids=(ref[j],))
    plain = run(tiny(MODEL), PROMPT, params)
    assert plain.cache_lengths[-1] == len(PROMPT) + j
    r = run(tiny(MODEL), PROMPT, params, stop_proposer("replay", params), STOP_K)
    assert r.ids == plain.ids
    assert cache_violations(r, len(PROMPT)) == []


@pytest.mark.parametrize("n", [1, 2, 10, 13, 23, 37])
@pytest.mark.parametrize("kind", ["replay", "draft-same"])
def test_max_new_tokens_not_a_multiple_of_k_plus_1(kind: str, n: int) -> None:
    ref = plain_greedy("draft-same", MODEL)
    params = greedy(n)
    r = run(tiny(MODEL), PROMPT, params, stop_proposer(kind, params), STOP_K)
    assert (r.ids, r.finish, r.stats.new_tokens) == (list(ref[:n]), "length", n)
    check_common(r, len(PROMPT), params)
    if kind == "replay":  # every pass is full but the last, cut to the budget
        assert r.stats.target_passes == 1 + math.ceil((n - 1) / (STOP_K + 1))


# -- statistics ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario, model_name, k", [
    ("ngram", "llama-gqa-untied", 4), ("ngram", "qwen2-qkv-bias", 8),
    ("draft-random", "qwen2-qkv-bias", 4), ("draft-same", "llama-gqa-untied", 2),
])
def test_statistics_are_consistent(scenario: str, model_name: str, k: int) -> None:
    r, proposer = spec_run(scenario, model_name, k)
    s = r.stats
    assert s.new_tokens == len(r.ids) == MAX_NEW
    assert s.target_passes == len(r.events)  # one event per target pass
    # Per pass (= per event): drafts verified d and accepted a, from the cumulative statistics. The
    # engine may verify only a prefix of a proposal, never more; the prefill pass drafts nothing.
    per_pass, prev = [], GenerationStats()
    for i, event in enumerate(r.events):
        e = event.stats
        d, a = e.drafted_tokens - prev.drafted_tokens, e.accepted_tokens - prev.accepted_tokens
        assert 0 <= a <= d and e.target_passes == prev.target_passes + 1
        assert len(event.token_ids) == a + 1 == e.new_tokens - prev.new_tokens  # accepted + 1 target token
        if i == 0:
            assert d == 0
        else:
            proposal = proposer.proposals[i - 1]
            assert d <= len(proposal) <= k
            assert event.token_ids[:a] == proposal[:a]  # what was accepted is what was drafted
        per_pass.append((d, a))
        prev = e
    assert len(proposer.proposals) == len(r.events) - 1  # nothing proposed after the last pass
    assert s.drafted_tokens == sum(d for d, _ in per_pass) == sum(s.drafted_at) > 0
    assert s.accepted_tokens == sum(a for _, a in per_pass) == sum(s.accepted_at)
    assert len(s.drafted_at) == len(s.accepted_at) == max(d for d, _ in per_pass)
    # Position i counts the passes whose draft reached it, and those that accepted it.
    assert s.drafted_at == [sum(d > i for d, _ in per_pass) for i in range(len(s.drafted_at))]
    assert s.accepted_at == [sum(a > i for _, a in per_pass) for i in range(len(s.accepted_at))]
    assert all(a <= d for a, d in zip(s.accepted_at, s.drafted_at))
    assert s.acceptance_by_position == pytest.approx([a / d for a, d in zip(s.accepted_at, s.drafted_at)])
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)
    assert s.tokens_per_pass == pytest.approx(s.new_tokens / s.target_passes)
    # Every pass commits its accepted drafts and one target token (finish by length, budget-capped drafts).
    assert s.new_tokens == s.target_passes + s.accepted_tokens
    assert s.propose_s > 0 and s.verify_s > 0 and s.other_s >= 0
    assert s.propose_s + s.verify_s <= s.total_s * (1 + 1e-6)
    d = s.to_dict()
    assert {"drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_pass",
            "acceptance_by_position", "propose_s", "verify_s", "other_s", "target_passes"} <= set(d)
    assert d["acceptance_by_position"] == s.acceptance_by_position


def test_plain_statistics_have_no_drafts() -> None:
    r = run(tiny(MODEL), PROMPT, greedy(12), check_kv=False)
    s = r.stats
    assert (s.target_passes, s.drafted_tokens, s.accepted_tokens, s.drafted_at) == (12, 0, 0, [])
    assert (s.acceptance_rate, s.tokens_per_pass, s.propose_s) == (0.0, 1.0, 0.0)


# -- sampling end to end: the law of the first tokens is plain sampling's ----------------------------------

def sampled_counts(proposer_kind: str | None, params: SamplingParams, seed0: int,
                   device: str = "cpu") -> tuple[torch.Tensor, int, int]:
    """Counts [V]*N_TOKENS of the first tokens over N_SAMPLES seeds; total drafted and accepted."""
    target, draft = tiny16(device), tiny16_draft(device)
    counts = torch.zeros([V16] * N_TOKENS, dtype=torch.long)
    drafted = accepted = 0
    drafter = Drafter(draft)  # one cache: each request takes a row, freed when it is done
    for seed in range(seed0, seed0 + N_SAMPLES):
        p = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = None
        if proposer_kind == "draft":
            proposer = DraftModelProposer(drafter, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + SAMPLE_K + 1)
        elif proposer_kind == "ngram":
            proposer = NgramProposer(PROMPT16, 4, 1)
        ids, stats = [], None
        for event in generate_tokens(target, PROMPT16, p, frozenset(), proposer, SAMPLE_K if proposer else 0):
            ids += event.token_ids
            stats = event.stats
        assert len(ids) == SAMPLE_NEW
        counts[tuple(ids[:N_TOKENS])] += 1
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    return counts, drafted, accepted


SAMPLING_CASES = {
    # name: (proposer, params, seed offset)
    "draft-t1": ("draft", SamplingParams(temperature=1.0), 0),
    "draft-t1-topp0.9": ("draft", SamplingParams(temperature=1.0, top_p=0.9), 10_000),
    "ngram-t1": ("ngram", SamplingParams(temperature=1.0), 20_000),
}


@functools.lru_cache(maxsize=None)
def sampled(case: str) -> tuple[torch.Tensor, int, int]:
    kind, params, seed0 = SAMPLING_CASES[case]
    return sampled_counts(kind, params, seed0)


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampling_law_of_first_tokens_is_plain_sampling(case: str) -> None:
    kind, params, _ = SAMPLING_CASES[case]
    counts, drafted, accepted = sampled(case)
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted, params)


@pytest.mark.parametrize("case", ["draft-t1", "ngram-t1"])
def test_sampling_law_negative_control(case: str) -> None:
    """The same draws tested against plain sampling at another temperature must fail: the test
    can see a distribution shift of this size with N_SAMPLES draws."""
    counts, _, _ = sampled(case)
    other = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=0.75), N_TOKENS)
    assert chi_square_p_value(counts, other) < ALPHA
