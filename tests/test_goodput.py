"""The one goodput model (quickdraft/spec/goodput.py) that the engine's policy and a draft model's
drafter both ask, and the acceptance counts every estimating proposer keeps."""
import pytest

from quickdraft.spec.goodput import EMA, Acceptance, agreement, best_extension, smoothed


def test_best_extension_takes_the_prefix_with_the_best_rate() -> None:
    # 2 tokens in 10 s; each extra token costs 5 s: 2.9 / 15 and 3.0 / 20 < 0.2 -> nothing; at 0.1 s:
    # 2.9 / 10.1, then 3.0 / 10.2 (better), then 3.01 / 10.3 (worse)
    assert best_extension(2.0, [0.9, 0.1], lambda n: 10.0 + 5.0 * n) == (0, 0.2)
    n, rate = best_extension(2.0, [0.9, 0.1, 0.01], lambda n: 10.0 + 0.1 * n)
    assert n == 2 and rate == pytest.approx(3.0 / 10.2)
    # a tie keeps the shorter extension: the same rate is no reason to verify more
    assert best_extension(1.0, [1.0], lambda n: 1.0 + n)[0] == 0


def test_agreement_judges_up_to_the_first_difference() -> None:
    assert agreement([5, 6, 7], [5, 6, 8, 9]) == (2, 3)  # two accepted, the third rejected
    assert agreement([5, 6], [5, 6, 7]) == (2, 2)         # all accepted: nothing rejected
    assert agreement([5, 6, 7], [5]) == (1, 1)            # past the committed text: not judged
    assert agreement([], [1]) == (0, 0)


def test_acceptance_counts_and_blends_with_a_prior() -> None:
    a = Acceptance()
    assert a.rate == pytest.approx(1 / 3)  # before any evidence
    a.judge([1, 2, 3], [1, 2, 4])
    assert (a.hits, a.trials) == (3.0, 6.0)
    own, shared = Acceptance(0.0, 0.0), Acceptance(3.0, 4.0)
    assert own.toward(shared, 4.0) == pytest.approx(0.75)  # no record of its own: the prior's rate
    own.record(0.0, 12.0)
    assert own.toward(shared, 4.0) == pytest.approx(3.0 / 16.0)


def test_smoothing_starts_at_the_first_measurement() -> None:
    assert smoothed(None, 2.0) == 2.0
    assert smoothed(2.0, 4.0) == pytest.approx(2.0 + EMA * 2.0)
