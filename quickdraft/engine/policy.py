"""How many draft tokens to verify this step: the length that maximizes expected committed tokens
per unit of step time.

If each draft token is accepted with probability a (given the ones before it were), verifying j
drafts commits E(j) = 1 + a + ... + a^j tokens in expectation, and a step feeding j+1 tokens costs
c(j+1) = t(j+1)/t(1) plain steps. The cost curve starts from a prior and follows the step times
this engine measures, so it adapts to the machine it runs on (steeper on a CPU than on a GPU).
"""
from __future__ import annotations

EMA = 0.2  # weight of a new step-time measurement


class DraftLengthPolicy:
    def __init__(self, k_max: int, prior_slope: float = 0.1) -> None:
        self.k_max = k_max
        self.prior_slope = prior_slope
        self.step_s: dict[int, float] = {}  # tokens fed -> smoothed seconds per step

    def cost(self, q: int) -> float:
        """c(q) = t(q) / t(1): measured where both are known, the prior line otherwise."""
        t1, tq = self.step_s.get(1), self.step_s.get(q)
        if q == 1:
            return 1.0
        if t1 and tq:
            return max(tq / t1, 1.0)
        return 1.0 + self.prior_slope * (q - 1)

    def choose(self, available: int, accept_prob: float | None) -> int:
        """Draft tokens to verify out of `available`; all of them when the proposer gives no estimate."""
        available = min(available, self.k_max)
        if accept_prob is None or available == 0:
            return available
        best, best_rate, expected, term = 0, 1.0, 1.0, 1.0
        for j in range(1, available + 1):
            term *= accept_prob
            expected += term
            rate = expected / self.cost(j + 1)
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    def observe(self, fed: int, seconds: float) -> None:
        """A step that fed `fed` tokens (the last committed one + drafts) took `seconds`."""
        old = self.step_s.get(fed)
        self.step_s[fed] = seconds if old is None else (1 - EMA) * old + EMA * seconds
