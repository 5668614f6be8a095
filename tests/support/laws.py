"""Statistical oracles: the chi-square test, the toy laws verify's tests draw from, plain sampling's law."""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from quickdraft.model.llama import Transformer
from quickdraft.spec.sampling import SamplingParams, probabilities

# -- the chi-square test -------------------------------------------------------------------------------

# A correct verifier fails one chi-square check with probability ALPHA (one run in a million);
# the draws are seeded, so a given run either passes or fails deterministically.
ALPHA = 1e-6


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> float:
    """Pearson goodness-of-fit p-value of `counts` against `probs` (same shape, any dims).

    Cells with probability 0 are left out (callers assert separately that none was drawn); cells
    expecting fewer than `min_expected` draws are pooled into one, so the chi-square approximation
    holds. The survival function is the regularised upper incomplete gamma Q(df/2, x/2).
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    support = probs > 0
    big = support & (n * probs >= min_expected)
    small = support & ~big
    obs = [counts[big]]
    exp = [n * probs[big]]
    if small.any():
        obs.append(counts[small].sum()[None])
        exp.append(n * probs[small].sum()[None])
    obs, exp = torch.cat(obs), torch.cat(exp)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    assert df >= 1, "a goodness-of-fit test needs at least two cells"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# -- verify's toy laws (test_verify.py) ----------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)
V = 10


def clear_logits(argmaxes: Sequence[int], seed: int = 0) -> torch.Tensor:
    """[len, V] logits: small random values everywhere, 5.0 at each position's argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(len(argmaxes), V, generator=g)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes, dtype=torch.long)] = 5.0
    return logits


# Vocabulary of 6: q is far from p; token 4 has p > 0 = q (never drafted, reached only by recovery),
# token 5 has q > 0 = p (drafted often, must always be rejected).
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
Q = torch.tensor([0.05, 0.10, 0.20, 0.25, 0.00, 0.40])
N_K1 = 40_000  # ~110 us per row on one CPU thread; see the power notes in each test


def log(p: torch.Tensor) -> torch.Tensor:
    return p.log()  # log 0 = -inf: softmax gives exactly 0 there


def counts_of(tokens: list[int], V_: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V_)


# A Markov "language model" over 5 tokens: p(next | last) = PM[last], q(next | last) = QM[last].
# Zeros on both sides: tokens p can emit but q never drafts, and drafts p forbids.
PM = torch.tensor([[0.40, 0.30, 0.20, 0.10, 0.00],
                   [0.10, 0.00, 0.50, 0.20, 0.20],
                   [0.25, 0.25, 0.25, 0.25, 0.00],
                   [0.00, 0.60, 0.10, 0.10, 0.20],
                   [0.30, 0.10, 0.10, 0.10, 0.40]])
QM = torch.tensor([[0.10, 0.00, 0.30, 0.30, 0.30],
                   [0.40, 0.30, 0.10, 0.20, 0.00],
                   [0.00, 0.50, 0.10, 0.20, 0.20],
                   [0.30, 0.30, 0.00, 0.20, 0.20],
                   [0.20, 0.20, 0.20, 0.20, 0.20]])
C0 = 0  # the context's last token
JOINT = PM[C0][:, None] * PM  # law of (t1, t2) under plain sampling from p


# -- plain sampling's law of the first tokens after PROMPT16 -------------------------------------------

PROMPT16 = [3, 7, 11, 3, 7, 11, 3, 7]
N_SAMPLES = 800
N_TOKENS = 3          # the law of the first 3 tokens is tested ...
SAMPLE_NEW = 4        # ... of 4-token generations: the step after prefill drafts min(k, 2) tokens
SAMPLE_K = 3


@torch.inference_mode()
def plain_law(model: Transformer, prompt: Sequence[int], params: SamplingParams, n: int) -> torch.Tensor:
    """[V]*n: P(first n tokens) under plain sampling, from one batched forward per depth."""
    V = model.config.vocab_size
    law = torch.ones((), dtype=torch.float64)
    for depth in range(n):
        ids = torch.tensor([list(prompt) + list(p) for p in itertools.product(range(V), repeat=depth)])
        B, L = ids.shape
        logits = model(ids, torch.arange(L).expand(B, L), model.new_cache(B, L), last_n=1).logits[:, -1]
        law = law[..., None] * probabilities(logits, params).double().view(*([V] * depth), V)
    return law


def assert_plain_sampling_law(model: Transformer, counts: torch.Tensor, drafted: int, accepted: int,
                              params: SamplingParams = SamplingParams(temperature=1.0)) -> None:
    """Counts of the first N_TOKENS tokens after PROMPT16 follow plain sampling's exact law; the
    premise that drafts were made and both accepted and rejected (recovery ran) is checked too."""
    assert 0 < accepted < drafted, (accepted, drafted)
    law = plain_law(model, PROMPT16, params, N_TOKENS)
    assert (counts[law == 0] == 0).all(), "a sequence plain sampling cannot produce was emitted"
    assert chi_square_p_value(counts, law) > ALPHA
