"""logit_bias and min_p (issue 36 item 4): applied to the target's logits (p) and the proposer's (q)
alike, so speculation stays exact with them.

Oracles: the processed distribution by hand; plain decoding through the same engine with the same
settings (greedy, token for token); the exact law of the first tokens under plain sampling with the
settings (chi-square, ALPHA 1e-6, seeded), with a negative control (the law without them) the same
draws must fail; the Python API's output for the server's.
"""
from __future__ import annotations

import re
from dataclasses import replace

import httpx
import pytest
import torch

from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.errors import InvalidSamplingParams
from quickdraft.proposers.base import Draft, SpecConfig
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.server.openapi import ids_up_to
from quickdraft.spec.sampling import MAX_LOGIT_BIAS, SamplingParams, probabilities
from quickdraft.spec.verify import verify
from support.engine import Job, draft_same, first_tokens_in_batches, ngram, run_batched, target
from support.laws import (
    ALPHA,
    N_SAMPLES,
    PROMPT16,
    SAMPLE_K,
    SAMPLE_NEW,
    assert_plain_sampling_law,
    chi_square_p_value,
    plain_law,
)
from support.models import V16, tiny16, tiny16_draft
from support.server import NAME, Server

BIAS16 = {3: 2.0, 7: -3.0, 11: 1.5, 0: 0.7}


def test_params_take_a_mapping_and_refuse_what_is_not_one() -> None:
    assert SamplingParams(logit_bias={7: 1, 2: -0.5}).logit_bias == ((2, -0.5), (7, 1.0))
    assert SamplingParams(logit_bias=[(4, 100)]).logit_bias == ((4, 100.0),)
    for bad in ({-1: 1.0}, {3: 100.5}, {True: 1.0}, {3: "1"}, {3: float("nan")}, [(1, 1.0), (1, 2.0)], "x",
                {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}):
        with pytest.raises(InvalidSamplingParams, match="logit_bias must map"):
            SamplingParams(logit_bias=bad)


def test_probabilities_and_greedy_verify_read_the_biased_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    params = SamplingParams(temperature=1.0, logit_bias={0: 3.0, 2: -1.0})
    expected = torch.softmax(logits + torch.tensor([3.0, 0.0, -1.0, 0.0]), -1)
    assert torch.allclose(probabilities(logits, params), expected)
    greedy = SamplingParams(logit_bias={0: 3.0})
    assert verify([Draft([2])], logits.expand(2, 4)[None], [greedy], [torch.Generator()]).tokens == [[0]]
    with pytest.raises(InvalidSamplingParams, match="names token 9"):
        probabilities(logits, SamplingParams(logit_bias={9: 1.0}))


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_greedy_with_a_bias_speculation_equals_plain(policy: str) -> None:
    bias = {5: 3.0, 6: 2.5, 9: -4.0, 17: 2.0}
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, logit_bias=bias)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8]
    jobs = [Job(prompt, params, None, 0), Job(prompt, params, ngram, 6), Job(prompt, params, draft_same, 3),
            Job(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), None, 0)]
    out, _, violations = run_batched(target(), jobs, EngineConfig(max_batch=4, policy=policy))
    assert not violations
    assert out["0"] == out["1"] == out["2"] != out["3"]


def draws(params: SamplingParams) -> tuple[torch.Tensor, int, int]:
    """The first tokens of N_SAMPLES seeded requests drafting with a draft model (q is not p)."""
    drafter = Drafter(tiny16_draft())
    requests = []
    for seed in range(N_SAMPLES):
        p = replace(params, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        requests.append(Request(PROMPT16, p, frozenset(), DraftModelProposer(
            drafter, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + SAMPLE_K + 1), SAMPLE_K, id=str(seed)))
    return first_tokens_in_batches(tiny16(), requests)


def test_sampling_with_a_bias_follows_the_biased_law_and_not_the_plain_one() -> None:
    params = SamplingParams(temperature=1.0, logit_bias=BIAS16)
    counts, drafted, accepted = draws(params)
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted, params)
    # negative control: the same draws against the law without the bias
    assert chi_square_p_value(counts, plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0), 3)) < ALPHA


@pytest.mark.parametrize("m", [0, 1, 9, 10, 99, 100, 299, 1000, 49151, 151935])
def test_the_published_bound_on_logit_bias_ids_holds_exactly_the_vocabulary(m: int) -> None:
    pattern = re.compile(ids_up_to(m))
    assert all(bool(pattern.fullmatch(str(x))) == (x <= m) for x in range(m + 1000))
    assert not any(pattern.fullmatch(text) for text in ("", "01", "-1", "1.0", " 1"))


@pytest.fixture(scope="module")
def server(llm) -> Server:
    s = Server(llm, max_batch=4)
    yield s
    s.stop()


def test_the_server_takes_logit_bias(server: Server, llm) -> None:
    bias = {"100": 5.0, "101": 4.0, "3": -100}
    r = server.client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0, logit_bias=bias,
                                         extra_body={"speculative": {"method": "ngram", "k": 4}})
    plain = llm.generate("abc", params=SamplingParams(max_new_tokens=16, logit_bias={100: 5.0, 101: 4.0, 3: -100}))
    assert r.choices[0].text == plain.text != llm.generate("abc", params=SamplingParams(max_new_tokens=16)).text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias")
    published = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        assert published[request]["properties"]["logit_bias"]["anyOf"][0]["propertyNames"] == {
            "pattern": ids_up_to(llm.model.config.vocab_size - 1)}


def test_a_heads_q_on_its_draft_vocabulary_takes_the_bias_by_the_targets_ids() -> None:
    """A head drafts on a vocabulary of its own (draft index i is target token vocab[i]): the bias
    names target ids, so token 3 (draft index 2) gets its bias and token 4 (not drafted) none."""
    from quickdraft.proposers.head import HeadProposer
    from support.heads import random_head

    vocab = [0, 2, 3, 5, 7, 8, 11, 13, 14]
    model = tiny16()
    params = SamplingParams(temperature=1.0, logit_bias={3: 5.0, 4: 9.0})
    proposer = HeadProposer(random_head(model, 2, vocab), model, PROMPT16, params, 64)
    logits = torch.randn(1, len(vocab), generator=torch.Generator().manual_seed(0))
    q = proposer._q(logits)
    shifted = logits.clone()
    shifted[0, vocab.index(3)] += 5.0
    expected = torch.zeros(1, V16).index_copy_(1, torch.tensor(vocab), torch.softmax(shifted, -1))
    assert torch.allclose(q, expected, atol=1e-6) and q[0, 4] == 0
    unbiased = HeadProposer(random_head(model, 2, vocab), model, PROMPT16, SamplingParams(temperature=1.0), 64)
    assert torch.allclose(unbiased._q(logits)[0, vocab], torch.softmax(logits, -1)[0], atol=1e-6)


# -- min_p ----------------------------------------------------------------------------------------------------

def test_min_p_cuts_what_is_less_likely_than_a_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    q = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2))  # cut below 0.2 * 0.5 = 0.1
    assert torch.allclose(q, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)
    only_max = probabilities(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert torch.equal(only_max, torch.tensor([[1.0, 0, 0, 0]]))
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(InvalidSamplingParams, match="min_p must be"):
            SamplingParams(min_p=bad)


def test_sampling_with_min_p_follows_its_law_and_not_the_plain_one() -> None:
    params = SamplingParams(temperature=1.0, min_p=0.15)
    counts, drafted, accepted = draws(params)
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted, params)
    assert chi_square_p_value(counts, plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0), 3)) < ALPHA


def test_the_server_takes_min_p(server: Server, llm) -> None:
    r = server.client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=1.0, seed=7,
                                         extra_body={"min_p": 0.3, "speculative": {"method": "ngram", "k": 4}})
    alone = llm.generate("abc", params=SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, min_p=0.3),
                         spec=SpecConfig("ngram", k=4))  # seeded: the same draws as the server's request
    assert r.choices[0].text == alone.text
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={"model": NAME, "prompt": "hi", "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p"
