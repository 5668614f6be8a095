"""How many draft tokens each row verifies this step: the lengths that maximize expected committed
tokens per unit of step time, for the whole batch at once.

If a row's draft tokens are each accepted with probability a (given the ones before were), verifying
j of them commits 1 + a + ... + a^j tokens in expectation; a step that feeds N tokens in all costs
t(N). With B rows the policy picks draft lengths d_b maximizing (sum_b E_b(d_b)) / t(B + sum d_b),
so one row on a memory-bound pass verifies a long draft while a large batch on a compute-bound CPU
verifies few drafts or none: speculation turns itself off when verification stops being nearly free.
t(N) starts from a prior line (or the measured forward-cost curve) and follows the step times the
engine observes, so it adapts to the machine it runs on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

EMA = 0.2            # weight of a new step-time measurement
PRIOR_SLOPE = 0.1    # t(N) / t(1) = 1 + 0.1 (N - 1) until measured
PolicyName = Literal["goodput", "fixed"]
POLICIES: tuple[str, ...] = ("goodput", "fixed")


class StepCost:
    """t(N): seconds of one engine step that feeds N tokens, smoothed per N."""

    def __init__(self, prior_slope: float = PRIOR_SLOPE) -> None:
        self.prior_slope = prior_slope
        self.step_s: dict[int, float] = {}

    def _prior(self, n: int) -> float:
        return 1.0 + self.prior_slope * (n - 1)

    def estimate(self, n: int) -> float:
        """Measured where known; elsewhere the prior line scaled through the nearest measured N
        (only ratios of estimates matter, so an unmeasured machine gets the prior's ratios)."""
        if n in self.step_s:
            return self.step_s[n]
        if not self.step_s:
            return self._prior(n)
        near = min(self.step_s, key=lambda m: (abs(m - n), m))
        return self.step_s[near] * self._prior(n) / self._prior(near)

    def observe(self, n: int, seconds: float) -> None:
        old = self.step_s.get(n)
        self.step_s[n] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def seed(self, median_s: dict[int, float]) -> None:
        """Start from a measured forward-cost curve (engine.cost.measure_forward_cost)."""
        for n, seconds in median_s.items():
            self.step_s.setdefault(n, seconds)


@dataclass(frozen=True)
class RowDraft:
    available: int              # draft tokens the row's proposer offers this step
    accept_prob: float | None   # its estimate per token; None = no estimate
    pinned: bool                # verify all `available`: the row's draft lengths must not depend
                                # on timing or on other rows (seeded sampling, adaptive off)


def choose_draft_lengths(rows: Sequence[RowDraft], cost: StepCost, policy: PolicyName = "goodput",
                         max_step_tokens: int | None = None) -> list[int]:
    """Draft tokens to verify per row. "fixed" verifies every offered token; "goodput" maximizes
    expected tokens per second, never feeding more than max_step_tokens in one step except for
    pinned rows (their drafts always go in)."""
    lengths = [r.available if r.pinned or r.accept_prob is None or policy == "fixed" else 0
               for r in rows]
    if policy == "fixed":
        return lengths
    fed = len(rows) + sum(lengths)
    # Each candidate is one more draft token of a row: its marginal expected gain a^j. Gains fall
    # along a row, so taking candidates in descending order extends every row by a prefix.
    candidates = sorted(((r.accept_prob ** j, b) for b, r in enumerate(rows) if lengths[b] == 0
                         for j in range(1, r.available + 1)), key=lambda c: -c[0])
    expected, best, best_rate = float(len(rows)), 0, len(rows) / cost.estimate(fed)
    for i, (gain, _) in enumerate(candidates):
        n = fed + i + 1
        if max_step_tokens is not None and n > max_step_tokens:
            break
        expected += gain
        rate = expected / cost.estimate(n)
        if rate > best_rate:
            best, best_rate = i + 1, rate
    for _, b in candidates[:best]:
        lengths[b] += 1
    return lengths
