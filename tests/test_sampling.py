"""probabilities() and sample(): the logits -> p transform and the draws made from it.

Oracles: hand-computed distributions on small vocabularies, softmax written out directly, and a
chi-square goodness-of-fit test (with a negative control it must reject) for the draws.
"""
from __future__ import annotations

import math

import pytest
import torch

from quickdraft.spec.sampling import SamplingParams, probabilities, sample

V = 8


def params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


# -- probabilities ---------------------------------------------------------------------------------

def test_greedy_is_one_hot_at_argmax() -> None:
    logits = random_logits(5, 3, V)  # [B, k+1, V]: the shape the verifier uses
    p = probabilities(logits, params(temperature=0.0))
    assert p.shape == logits.shape and p.dtype == torch.float32
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.equal(p.sum(-1), torch.ones(5, 3))
    assert torch.equal((p == 1).sum(-1), torch.ones(5, 3, dtype=torch.long))
    assert torch.equal((p == 0).sum(-1), torch.full((5, 3), V - 1))


def test_greedy_of_half_precision_logits_is_float32_one_hot() -> None:
    logits = random_logits(2, V).to(torch.bfloat16)
    p = probabilities(logits, params())
    assert p.dtype == torch.float32
    assert torch.equal(p.argmax(-1), logits.float().argmax(-1)) and torch.equal(p.sum(-1), torch.ones(2))


def test_temperature_hand_computed() -> None:
    logits = torch.tensor([0.0, math.log(2), math.log(4)])
    torch.testing.assert_close(probabilities(logits, params(temperature=1.0)),
                               torch.tensor([1, 2, 4]) / 7.0)
    # T = 2 halves the logits: weights 1, sqrt(2), 2.
    r = math.sqrt(2)
    torch.testing.assert_close(probabilities(logits, params(temperature=2.0)),
                               torch.tensor([1, r, 2]) / (3 + r))
    # Low temperature sharpens towards the argmax without becoming exactly one-hot.
    cold = probabilities(logits, params(temperature=0.05))
    assert cold[2] > 0.999 and cold[0] > 0


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    logits = random_logits(4, V, seed=1)
    expected = torch.exp(logits / temperature)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(probabilities(logits, params(temperature=temperature)), expected)


@pytest.mark.parametrize("k", [1, 2, 5, V - 1])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    logits = random_logits(6, V, seed=2)  # continuous values: no ties
    p = probabilities(logits, params(temperature=1.0, top_k=k))
    assert torch.equal((p > 0).sum(-1), torch.full((6,), k))
    top = logits.topk(k, dim=-1).indices
    kept = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top, True)
    assert torch.equal(p > 0, kept)
    # Renormalised softmax over the kept tokens only.
    expected = torch.exp(logits).masked_fill(~kept, 0.0)
    torch.testing.assert_close(p, expected / expected.sum(-1, keepdim=True))


def test_top_k_at_or_above_vocab_size_is_no_cut() -> None:
    logits = random_logits(3, V, seed=3)
    full = probabilities(logits, params(temperature=1.0))
    torch.testing.assert_close(probabilities(logits, params(temperature=1.0, top_k=V)), full)
    torch.testing.assert_close(probabilities(logits, params(temperature=1.0, top_k=V + 10)), full)
    assert (full > 0).all()


# p = [0.5, 0.3, 0.15, 0.05] placed at shuffled positions so the sort/scatter path is exercised.
TOP_P_ORDER = [2, 0, 3, 1]  # token index holding the i-th largest probability
TOP_P_PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("top_p, kept", [
    (0.4, [0.5]),                    # the first token alone already reaches 0.4
    (0.75, [0.5, 0.3]),              # 0.5 < 0.75 <= 0.8
    (0.81, [0.5, 0.3, 0.15]),        # 0.8 < 0.81 <= 0.95
    (0.96, [0.5, 0.3, 0.15, 0.05]),  # needs everything
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: list[float]) -> None:
    logits = torch.empty(4)
    for rank, token in enumerate(TOP_P_ORDER):
        logits[token] = math.log(TOP_P_PROBS[rank])
    expected = torch.zeros(4)
    for rank, prob in enumerate(kept):
        expected[TOP_P_ORDER[rank]] = prob / sum(kept)
    torch.testing.assert_close(probabilities(logits, params(temperature=1.0, top_p=top_p)), expected)


def test_top_k_then_top_p_then_renormalise() -> None:
    # After top_k=3 the kept mass [0.5, 0.3, 0.15] renormalises to [10/19, 6/19, 3/19];
    # top_p=0.8 then needs the first two (10/19 = 0.526 < 0.8 <= 16/19 = 0.842).
    logits = torch.tensor([math.log(x) for x in TOP_P_PROBS])
    p = probabilities(logits, params(temperature=1.0, top_k=3, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([10 / 16, 6 / 16, 0.0, 0.0]))


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.01), dict(temperature=5.0, top_k=3),
    dict(temperature=0.7, top_p=0.5), dict(temperature=1.3, top_k=4, top_p=0.9), dict(temperature=0.0),
])
def test_rows_are_distributions(kw: dict) -> None:
    logits = random_logits(3, 5, 64, seed=4) * 10  # wide logits: exercises overflow paths
    logits[0, 0, :10] = float("-inf")             # masked entries (e.g. a grammar) stay at zero
    p = probabilities(logits, params(**kw))
    assert p.shape == logits.shape
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 5))
    assert (p[0, 0, :10] == 0).all()


# Extreme settings that validation accepts. Before the logits were shifted by their max, a
# temperature of 1e-38 overflowed l / T to +inf (softmax: inf - inf = NaN), one under float32's
# smallest positive value made 0 / 0 at the max, and a top_p that is 0 in float32 cut every token.
TINY_TEMPERATURES = [1e-38, 2.0 ** -149, 1e-46, 5e-324, 1e-300]


def wide_logits(seed: int) -> torch.Tensor:
    logits = random_logits(3, 5, 64, seed=seed) * 1000  # [B, k+1, V], gaps far beyond exp's range
    logits[0, 0, :10] = float("-inf")
    return logits


def assert_distributions(p: torch.Tensor, logits: torch.Tensor) -> None:
    assert p.shape == logits.shape and p.dtype == torch.float32
    assert torch.isfinite(p).all() and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(logits.shape[:-1]))
    assert (p[logits == float("-inf")] == 0).all()


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
@pytest.mark.parametrize("extra", [{}, dict(top_k=1), dict(top_k=5), dict(top_p=1e-46), dict(top_p=0.5)])
def test_tiny_temperature_is_greedy(temperature: float, extra: dict) -> None:
    logits = wide_logits(seed=6) / 1000
    p = probabilities(logits, params(temperature=temperature, **extra))
    assert_distributions(p, logits)
    assert torch.equal(p, probabilities(logits, params()))  # one-hot at the argmax, exactly
    tokens = sample(p, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_splits_tied_maxima_evenly(temperature: float) -> None:
    # The T -> 0 limit of softmax(l / T) is uniform over the tokens holding the max, 0 elsewhere.
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0, 3.0 - 1e-6, 3.0]])
    p = probabilities(logits, params(temperature=temperature))
    torch.testing.assert_close(p, torch.tensor([[0.0, 1 / 3, 0.0, 1 / 3, 0.0, 1 / 3]]))


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-30, 1e-7])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 100.0])
def test_tiny_top_p_keeps_the_most_probable_token(top_p: float, temperature: float) -> None:
    logits = wide_logits(seed=7) / 500
    p = probabilities(logits, params(temperature=temperature, top_p=top_p))
    assert_distributions(p, logits)
    assert torch.equal(p, probabilities(logits, params()))


@pytest.mark.parametrize("kw", [
    dict(temperature=100.0), dict(temperature=100.0, top_k=7), dict(temperature=0.01, top_p=0.3),
    dict(temperature=1.0, top_k=10**30), dict(temperature=3e-3, top_k=2, top_p=0.999999999),
])
def test_extreme_settings_match_float64_softmax(kw: dict) -> None:
    """Wide logits (gaps of thousands) against the textbook transform in float64."""
    logits = wide_logits(seed=8)
    p = probabilities(logits, params(**kw))
    assert_distributions(p, logits)
    scaled = logits.double() / kw["temperature"]
    top_k = kw.get("top_k", 0)
    if 0 < top_k < logits.shape[-1]:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[..., -1:], float("-inf"))
    expected = torch.softmax(scaled, -1)
    top_p = kw.get("top_p", 1.0)
    if top_p < 1.0:
        sorted_p, order = expected.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        expected = torch.zeros_like(expected).scatter_(-1, order, sorted_p * keep)
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(p.double(), expected, atol=1e-6, rtol=1e-5)


# -- sample -----------------------------------------------------------------------------------------

def test_sample_shape_and_one_hot_rows() -> None:
    logits = random_logits(4, 3, V, seed=5)
    p = probabilities(logits, params())
    tokens = sample(p, torch.Generator().manual_seed(0))
    assert tokens.shape == (4, 3)
    assert torch.equal(tokens, logits.argmax(-1))


def test_seeded_generators_reproduce_and_seeds_differ() -> None:
    p = torch.full((200, 50), 1 / 50)
    draws = lambda seed: sample(p, params(temperature=1.0, seed=seed).make_generator())
    assert torch.equal(draws(7), draws(7))
    # 200 uniform draws over 50 tokens agreeing by chance: probability 50**-200.
    assert not torch.equal(draws(7), draws(8))
    unseeded = params(temperature=1.0)
    assert not torch.equal(sample(p, unseeded.make_generator()), sample(p, unseeded.make_generator()))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value over the categories with probs > 0.

    The chi-square survival function is the regularised upper incomplete gamma Q(df/2, x/2),
    which torch provides, so no scipy is needed.
    """
    support = probs > 0
    n = counts.sum()
    expected = n * probs[support].double()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_p_value_matches_textbook_critical_values() -> None:
    # The helper itself: chi-square(7) upper 5% and 0.1% points are 14.067 and 24.322.
    probs = torch.full((8,), 1 / 8)
    for critical, alpha in [(14.067, 0.05), (24.322, 0.001)]:
        # counts whose statistic is exactly `critical`: N=800, two cells off by d, d^2/100*2 = critical
        d = math.sqrt(critical * 50)
        counts = torch.full((8,), 100.0, dtype=torch.float64)
        counts[0] += d
        counts[1] -= d
        assert chi_square_p_value(counts, probs) == pytest.approx(alpha, rel=1e-3)


# A correct sampler fails this test with probability ALPHA (per seed), i.e. one run in a million.
ALPHA = 1e-6
N_DRAWS = 100_000


def draw_counts(probs: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = sample(probs.expand(N_DRAWS, -1).contiguous(), g)
    return torch.bincount(tokens, minlength=probs.shape[-1])


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=6, top_p=0.95)])
def test_sample_follows_probabilities(kw: dict) -> None:
    p = probabilities(torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]), params(**kw))
    counts = draw_counts(p, seed=11)
    assert (counts[p == 0] == 0).all(), "a token cut by top-k/top-p was drawn"
    assert chi_square_p_value(counts, p) > ALPHA


def test_chi_square_rejects_a_different_distribution() -> None:
    # Negative control: draws from q, tested against p; q moves 0.02 of mass between two tokens
    # (total variation 0.02). Expected statistic ~ N * sum((q-p)^2 / p) ~ 1e5 * 0.012 = 1200, far
    # past the ALPHA critical value (~40.5 for 7 degrees of freedom).
    p = probabilities(torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]), params(temperature=0.8))
    q = p.clone()
    q[1] += 0.02
    q[4] -= 0.02
    assert chi_square_p_value(draw_counts(q, seed=11), p) < ALPHA
    # And the statistic itself: a matching distribution is accepted with the same draws' seed.
    assert chi_square_p_value(draw_counts(q, seed=11), q) > ALPHA


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaky: the candidates hold top_p; flat: full sort
def test_top_p_candidates_give_the_full_sort_result(scale: float) -> None:
    import quickdraft.spec.sampling as sampling

    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 5000, generator=g) * scale, dim=-1)
    assert (probs.topk(sampling.TOP_P_CANDIDATES).values.sum(-1) >= 0.9).all() == (scale > 1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.9
    expected = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(sampling._top_p(probs, 0.9), expected, atol=1e-7, rtol=0)


def test_sample_never_draws_a_zero_weight_and_flags_a_non_distribution() -> None:
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 1e-30], [float("nan")] * 4, [0.0] * 4])
    draws = torch.stack([sample(weights, torch.Generator().manual_seed(s)) for s in range(300)])  # [300, 4]
    assert set(draws[:, 0].tolist()) == {1, 3} and (draws[:, 1] == 3).all()
    assert (draws[:, 2:] == -1).all()  # NaN or all zero: no token


def test_top_p_gives_each_row_the_result_it_has_alone() -> None:
    """A row's kept tokens never depend on the rows beside it (verification scores positions only as
    far as its walk reaches, engine/scores.py): rows of tied probabilities straddling the cut, beside
    a flat row whose candidates hold less than top_p (its whole vocabulary is sorted), each as alone."""
    V = 1000
    tied = torch.full((V,), -20.0)
    tied[:300] = 2.0  # 300 equal tokens: the cut falls among them, which ones stay depends on the order
    rows = torch.stack([tied, torch.zeros(V), tied.roll(7)])
    probs = torch.softmax(rows, dim=-1)
    together = sampling_top_p(probs, 0.5)
    for i in range(len(rows)):
        assert torch.equal(together[i], sampling_top_p(probs[i:i + 1], 0.5)[0]), i


def sampling_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    import quickdraft.spec.sampling as sampling
    return sampling._top_p(probs, top_p)
