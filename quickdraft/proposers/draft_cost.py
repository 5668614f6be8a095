"""When a draft model's forwards pay: how many tokens to draft, per row and step, from their cost.

A draft model is not free on a CPU (the Qwen 0.5B's forward costs ~0.46 of its 1.5B target's), and
its tokens are spent before the engine's policy chooses what to verify. So the drafter weighs each
draft forward itself, as the policy weighs verification (engine/policy.py): a step with B rows
commits E tokens in expectation in C seconds; one more draft level for rows S adds
sum_{b in S} g_b expected tokens (g_b: the chance that row b's next draft token is reached and
accepted) and costs the level's forward plus |S| verified tokens. The level runs only if it
raises E / C. A large batch (verification compute-bound) or an unsure draft thus drafts little or
nothing, and speculation never costs more than it is expected to win.

Acceptance is learned, not assumed: for greedy rows the draft's own probability of its token is
mapped to the acceptance measured at that confidence (`Calibration`, shared by a draft model's
requests), like llama.cpp's p_min but calibrated. Sampled rows use the measured mean: an estimate
read from a drawn token (its q(x)) would decide whether that token is verified, which biases the
law; one that depends on the past only does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quickdraft.proposers.base import PassCost

BINS = 20          # confidence bins of the calibration
PRIOR_WEIGHT = 2.0  # pseudo-observations per bin at its own confidence (an uncalibrated draft's guess)
EMA = 0.2          # weight of a new forward-time measurement
EXPLORE = 16       # steps a row may go without drafting before it drafts once anyway (if a level
                   # could pay at the best acceptance measured): acceptance changes with the text,
                   # and a row that never drafts never learns it has


class Calibration:
    """P(a draft token is accepted | its parent was, the draft's confidence in it), per bin."""

    def __init__(self) -> None:
        self.accepted = [PRIOR_WEIGHT * (i + 0.5) / BINS for i in range(BINS)]
        self.offered = [PRIOR_WEIGHT] * BINS

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * BINS), 0), BINS - 1)

    def estimate(self, confidence: float) -> float:
        i = self._bin(confidence)
        return self.accepted[i] / self.offered[i]

    @property
    def best(self) -> float:
        """The acceptance of the most accepted confidence bin: the most a draft token can be
        expected to win, whatever the text."""
        return max(a / o for a, o in zip(self.accepted, self.offered))

    @property
    def mean(self) -> float:
        """Acceptance over all confidences: the estimate for a token not drafted yet."""
        return sum(self.accepted) / sum(self.offered)

    def record(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        """A chain's outcome: its first `verified` tokens were verified, the first `accepted` of
        them accepted; a token after the first rejected one tells nothing."""
        for i, c in enumerate(confidences[:min(verified, accepted + 1)]):
            self.accepted[self._bin(c)] += i < accepted
            self.offered[self._bin(c)] += 1


@dataclass
class Plan:
    """One step's expected tokens E and seconds C, as draft levels are added to it."""
    expected: float
    seconds: float

    @classmethod
    def of(cls, cost: PassCost) -> Plan:
        return cls(float(cost.rows), cost.seconds)

    def pays(self, gain: float, level_s: float, per_token: float) -> bool:
        """Whether one row's draft level winning `gain` tokens would raise E / C. Later levels win
        less (a token is reached only if its parent is accepted) at about the same cost, so when
        the first level cannot pay at the best acceptance, no draft can."""
        return (self.expected + gain) / (self.seconds + level_s + per_token) > self.expected / self.seconds

    def extend(self, forced: Sequence[float], gains: Sequence[float], level_s: float, per_token: float) -> int:
        """Add a draft level: the rows of `forced` draft whatever it costs (their lengths must not
        depend on timing, or they explore), of the others those with the largest `gains` (sorted,
        largest first) that raise E / C most: -> how many of `gains` go (0: none pays)."""
        self.expected += sum(forced)
        self.seconds += (level_s if forced else 0.0) + per_token * len(forced)
        level_s = 0.0 if forced else level_s  # paid already: the others add only their verification
        best, best_rate = 0, self.expected / self.seconds
        expected = self.expected
        for n, g in enumerate(gains, 1):
            expected += g
            rate = expected / (self.seconds + level_s + per_token * n)
            if rate > best_rate:
                best, best_rate = n, rate
        if best:
            self.expected += sum(gains[:best])
            self.seconds += level_s + per_token * best
        return best


def catch_up_pays(cost: PassCost, acceptance: float, k: int, first_s: float, later_s: float, remaining: int,
                  catch_up_s: float) -> bool:
    """Whether a row should start drafting when the draft must first catch up on many tokens (a
    request's prompt, once): the catch-up (`catch_up_s`) is paid once, and repaid only by the time
    drafting saves over the `remaining` tokens of the request. Alone in its step (the other rows
    as they are), a chain of i <= k tokens accepted at `acceptance` each commits
    1 + a + ... + a^i tokens a step in cost.seconds + first_s + (i - 1) later_s + i per_token,
    against 1 token in cost.seconds without: the best i's saving over `remaining` tokens must
    exceed the catch-up. Short requests, unsure drafts and busy batches then skip the prefill."""
    best_s_per_token = cost.seconds  # without drafting
    expected, seconds = 1.0, cost.seconds + first_s - later_s
    for i in range(1, k + 1):
        expected += acceptance ** i
        seconds += later_s + cost.per_token
        best_s_per_token = min(best_s_per_token, seconds / expected)
    return remaining * (cost.seconds - best_s_per_token) > catch_up_s


@dataclass
class ForwardTimes:
    """Seconds of the drafter's forwards (smoothed), by kind: the first of a proposal (it catches
    up on the committed tokens), the later ones of chains (one token per row), tree levels (a
    level's nodes per row), and a long catch-up (a prompt) per token it feeds."""
    first: float | None = None
    later: float | None = None
    tree: float | None = None
    catch_up: float | None = None

    def observe(self, kind: str, seconds: float) -> None:
        old = getattr(self, kind)
        setattr(self, kind, seconds if old is None else (1 - EMA) * old + EMA * seconds)
