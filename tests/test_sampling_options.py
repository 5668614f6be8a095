"""presence/frequency penalties and logprobs (issue 36 item 4), exact under speculation.

Oracles: penalties and path counts by hand; plain decoding through the same engine with the same
settings (greedy tokens, and every logprob bitwise); a teacher-forced forward of the whole
sequence (logprobs of sampled tokens, to a float tolerance); the exact law of the first tokens
under plain sampling with the penalties counting the tokens generated before each one
(chi-square, ALPHA 1e-6, seeded), with a negative control (the law without them) the same draws
must fail.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

import pytest
import torch

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.errors import InvalidSamplingParams
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import Draft
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.logprobs import token_logprobs
from quickdraft.spec.sampling import SamplingParams, penalize, probabilities
from quickdraft.spec.verify import node_paths
from support.engine import Job, draft_random, draft_same, drafter, first_tokens_in_batches, ngram, target
from support.laws import ALPHA, N_SAMPLES, N_TOKENS, PROMPT16, SAMPLE_K, SAMPLE_NEW, chi_square_p_value, plain_law
from support.models import tiny16, tiny16_draft

PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.4}


def test_params_bound_penalties_and_logprobs() -> None:
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2.0, logprobs=20).penalized
    assert not SamplingParams(logprobs=0).penalized
    for name, bad in [("presence_penalty", 2.01), ("frequency_penalty", -2.5), ("presence_penalty", float("nan")),
                      ("frequency_penalty", True), ("presence_penalty", "1"), ("logprobs", 21), ("logprobs", -1),
                      ("logprobs", True), ("logprobs", 1.0)]:
        with pytest.raises(InvalidSamplingParams, match=f"{name} must be"):
            SamplingParams(**{name: bad})


def test_penalties_subtract_openais_terms() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(logits, params, [2, 1, 2], [[], [2, 0]])  # c = [0, 1, 2, 0], then [1, 1, 3, 0]
    assert torch.equal(out, torch.tensor([[1.0, 2.0 - 0.25 - 0.5, 3.0 - 0.5 - 0.5, 4.0],
                                          [1.0 - 0.25 - 0.5, 2.0 - 0.25 - 0.5, 3.0 - 0.75 - 0.5, 4.0]]))
    assert torch.equal(penalize(logits, params, [], [[], []]), logits)


def test_each_tree_node_counts_its_own_path() -> None:
    # root -> 0:a(5) -> 1:b(6) -> 3:d(5); root -> 2:c(7)
    draft = Draft([5, 6, 7, 5], parents=[-1, 0, -1, 1])
    assert node_paths(draft) == [[], [5], [5, 6], [7], [5, 6, 5]]  # c's path holds not a, its sibling
    counts = -penalize(torch.zeros(5, 10), SamplingParams(frequency_penalty=1.0), [6, 6, 2], node_paths(draft))
    expected = torch.zeros(5, 10)
    expected[:, 6] += 2
    expected[:, 2] += 1
    expected[1, 5] += 1                          # after node 0: a
    expected[2, 5] += 1; expected[2, 6] += 1     # after node 1: a b
    expected[3, 7] += 1                          # after node 2: c
    expected[4, 5] += 2; expected[4, 6] += 1     # after node 3: a b a
    assert torch.equal(counts, expected)


def draft_tree(prompt: Sequence[int], params: SamplingParams) -> DraftModelProposer:
    return DraftModelProposer(drafter(0), prompt, params, len(prompt) + params.max_new_tokens + 4 * 9 + 1, 3)


def draft_random_tree(prompt: Sequence[int], params: SamplingParams) -> DraftModelProposer:
    return DraftModelProposer(drafter(1), prompt, params, len(prompt) + params.max_new_tokens + 4 * 9 + 1, 3)


PROPOSERS = {"ngram": (ngram, 6), "draft": (draft_same, 3), "draft-random": (draft_random, 2),
             "draft-tree": (draft_tree, 4), "draft-tree-random": (draft_random_tree, 4)}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [1, 17, 42, 8, 77, 23], [9, 2, 9, 2, 9, 2, 9]]


def run(model: Transformer, jobs: Sequence[Job], config: EngineConfig) -> tuple[dict, dict, dict]:
    """Tokens, logprobs and stats (drafted, accepted) per job, all through one engine."""
    engine = Engine(model, config)
    for i, job in enumerate(jobs):
        engine.add(job.request(str(i)))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    logprobs: dict[str, list] = {str(i): [] for i in range(len(jobs))}
    stats: dict[str, tuple[int, int]] = {}
    while engine.has_work():
        for rid, event in engine.step():
            assert event.error is None, event.error
            assert len(event.logprobs) == (len(event.token_ids) if jobs[int(rid)].params.logprobs is not None else 0)
            tokens[rid] += event.token_ids
            logprobs[rid] += event.logprobs
            if event.finish_reason:
                stats[rid] = (event.stats.drafted_tokens, event.stats.accepted_tokens)
    return tokens, logprobs, stats


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_greedy_with_penalties_and_logprobs_under_every_proposer_equals_plain(policy: str) -> None:
    """Batch N: each prompt plainly and under every proposer (chains and trees, drafts accepted and
    rejected) in one engine; tokens and logprobs (5 alternatives) equal plain decoding's, bitwise."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5, **PENALTIES)
    jobs = [Job(p, params, make, k) for p in PROMPTS for make, k in [(None, 0), *PROPOSERS.values()]]
    tokens, logprobs, stats = run(target(), jobs, EngineConfig(max_batch=6, policy=policy))
    per = 1 + len(PROPOSERS)
    for first in range(0, len(jobs), per):
        plain = str(first)
        for i in range(first + 1, first + per):
            assert tokens[str(i)] == tokens[plain], (jobs[i].make, jobs[i].prompt)
            assert logprobs[str(i)] == logprobs[plain], (jobs[i].make, jobs[i].prompt)
    assert all(len(lp.top) == 5 and lp.top[0][1] >= lp.top[-1][1] for lps in logprobs.values() for lp in lps)
    drafted = sum(stats[str(i)][0] for i in range(len(jobs)))
    accepted = sum(stats[str(i)][1] for i in range(len(jobs)))
    assert 0 < accepted < drafted  # the premise: drafts verified, some accepted, some rejected
    # the target drafting for itself, its draft processed as p: every chain token verified is accepted
    for i in range(2, len(jobs), per):
        assert stats[str(i)][0] == stats[str(i)][1] and (stats[str(i)][0] > 0 or policy == "goodput"), stats[str(i)]
    # the penalties change the output (else the test above could not fail)
    unpenalized, _, _ = run(target(), [Job(PROMPTS[0], replace(params, presence_penalty=0.0, frequency_penalty=0.0),
                                           None, 0)], EngineConfig())
    assert unpenalized["0"] != tokens["0"]


def test_logprobs_are_the_targets_raw_distribution_where_each_token_was_scored() -> None:
    """Sampled, penalized, under a draft model: each committed token's logprob and alternatives are
    log_softmax of the target's logits at its position (a teacher-forced forward of the sequence;
    before temperature, penalties and truncation), to float32 rounding across batch shapes."""
    model = target()
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_new_tokens=20, ignore_eos=True, logprobs=3,
                            **PENALTIES)
    tokens, logprobs, stats = run(model, [Job(PROMPTS[0], params, draft_same, 3)], EngineConfig())
    assert stats["0"][1] > 0  # drafted tokens were accepted: their logprobs come from verify passes
    seq = PROMPTS[0] + tokens["0"]
    with torch.inference_mode():
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], model.new_cache(1, len(seq))).logits
    expected = token_logprobs(logits[0, len(PROMPTS[0]) - 1:-1], tokens["0"], 3)
    for got, want in zip(logprobs["0"], expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


# -- the sampling law through a draft --------------------------------------------------------------------------

@torch.inference_mode()
def penalized_law(model: Transformer, prompt: Sequence[int], params: SamplingParams, n: int) -> torch.Tensor:
    """[V]*n: P(first n tokens) under plain sampling with penalties counting the tokens before each."""
    V = model.config.vocab_size
    law = torch.ones((), dtype=torch.float64)
    for depth in range(n):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
        B, L = ids.shape
        logits = model(ids, torch.arange(L).expand(B, L), model.new_cache(B, L), last_n=1).logits[:, -1]
        penalized = penalize(logits, params, [], [list(p) for p in prefixes])  # the prompt is not counted
        law = law[..., None] * probabilities(penalized, params).double().view(*([V] * depth), V)
    return law


@pytest.mark.parametrize("width", [1, 3])
def test_sampling_with_penalties_through_a_draft_follows_the_penalized_law(width: int) -> None:
    """Chains (q drawn from the draft's penalized distribution) and trees (each node's path counted)."""
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5)
    shared, requests = Drafter(tiny16_draft()), []
    for seed in range(N_SAMPLES):
        p = replace(params, seed=70_000 + seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        room = len(PROMPT16) + SAMPLE_NEW + (width + 1) * SAMPLE_K + 1
        requests.append(Request(PROMPT16, p, frozenset(), DraftModelProposer(shared, PROMPT16, p, room, width),
                                SAMPLE_K, id=str(seed)))
    counts, drafted, accepted = first_tokens_in_batches(tiny16(), requests)
    assert 0 < accepted < drafted, (accepted, drafted)
    law = penalized_law(tiny16(), PROMPT16, params, N_TOKENS)
    assert (counts[law == 0] == 0).all()
    assert chi_square_p_value(counts, law) > ALPHA
    # negative control: the same draws against the law without penalties
    assert chi_square_p_value(counts, plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0), N_TOKENS)) < ALPHA


@pytest.mark.parametrize("method", ["ngram", "ngram-tree", "draft-same", "draft-random", "draft-tree"])
def test_under_a_json_schema_tokens_and_logprobs_equal_constrained_plain_decodings(method: str) -> None:
    """Issue 36's acceptance: under a grammar's masks (and penalties), every proposer, batch 1 and N."""
    from support.grammar import EOS_ID, SCHEMAS, prompt_for, schema_constraint
    from support.grammar import PROPOSERS as GRAMMAR_PROPOSERS
    from support.grammar import target as grammar_target
    params = SamplingParams(max_new_tokens=60, logprobs=4, presence_penalty=0.3, frequency_penalty=0.2)

    def constrained(jobs: list[tuple[dict, str]], max_batch: int) -> list[tuple[list[int], list]]:
        engine = Engine(grammar_target(), EngineConfig(max_batch=max_batch))
        for i, (schema, name) in enumerate(jobs):
            make, k = GRAMMAR_PROPOSERS[name]
            prompt = prompt_for(schema)
            engine.add(Request(prompt, params, frozenset({EOS_ID}), make(prompt, params), k,
                               constraint=schema_constraint(schema), id=str(i)))
        out: dict[str, tuple[list[int], list]] = {str(i): ([], []) for i in range(len(jobs))}
        while engine.has_work():
            for rid, event in engine.step():
                assert event.error is None, event.error
                out[rid][0].extend(event.token_ids)
                out[rid][1].extend(event.logprobs)
        return [out[str(i)] for i in range(len(jobs))]

    schemas = SCHEMAS[:3]
    plain = constrained([(s, "plain") for s in schemas], 1)
    assert all(len(ids) == len(lps) > 0 for ids, lps in plain)
    assert constrained([(s, method) for s in schemas], 1) == plain
    assert constrained([(s, m) for s in schemas for m in ("plain", method)], 3) == [p for p in plain for _ in "ab"]
