"""How many draft tokens each row verifies this step: the lengths that maximize expected committed
tokens per unit of step time, for the whole batch at once.

If a row's draft token i is accepted with probability a_i (given the ones before were), verifying
j of them commits 1 + a_1 + a_1 a_2 + ... + a_1...a_j tokens in expectation; a step that feeds N tokens in all costs
t(N). With B rows the policy picks draft lengths d_b maximizing (sum_b E_b(d_b)) / t(B + sum d_b),
so one row on a memory-bound pass verifies a long draft while a large batch on a compute-bound CPU
verifies few drafts or none: speculation turns itself off when verification stops being nearly free.
t(N) follows the step times the engine observes, shaped between them by the forward-cost curve
measured at start-up (or a prior line), so it adapts to the machine it runs on.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Callable, Literal, Sequence

from quickdraft.spec.draft_contract import Draft
from quickdraft.spec.goodput import best_extension, smoothed

MIN_GAIN = 0.05      # draft only when it promises 5% more tokens/s than not drafting: step times
                     # and acceptance estimates are noisy, and picking the best-looking option
                     # favours the underestimated ones
PRIOR_SLOPE = 0.1    # t(N) / t(1) = 1 + 0.1 (N - 1) until measured
HEAD_PRIOR = 6.0     # an LM head call scoring n positions costs as n + 6 of them until measured: its
                     # weights' read is a fixed cost (bench forward-cost, head(q) for q = 1..9: 5-6 times
                     # each further position's on SmolLM2 and Qwen2.5-Coder-1.5B, AMD EPYC Zen 4)
STALE = 64           # steps timed: a size not timed in this many is no longer taken as measured
                     # (estimate falls back to the curve's shape from the fresh sizes) and its next
                     # time replaces the old. A size is timed only when the policy picks it, so one slow
                     # step (a new shape's first, the host's hiccup) at t(2) had made every draft look
                     # dear for the engine's life: drafts were declined, t(2) never timed again, and
                     # a run's tokens per pass fell by a third (docs/notes/smollm2.md)
PolicyName = Literal["goodput", "fixed"]
POLICIES: tuple[str, ...] = ("goodput", "fixed")


class StepCost:
    """t(N): seconds of one engine step that feeds N tokens.

    Measured steps (smoothed per N) are the truth; between and beyond them, the *shape* of a cost
    curve (the forward-cost curve measured at start-up, else a prior line) carries the measurements
    around (estimate). Only shapes are taken from the curve: it is measured on one row, while a
    batch of B rows also pays B rows of attention, so its absolute times would make drafts look
    cheaper than they are.
    """

    def __init__(self, prior_slope: float = PRIOR_SLOPE) -> None:
        self.prior_slope = prior_slope
        self.step_s: dict[int, float] = {}   # N -> smoothed seconds of this engine's steps
        self.timed = 0                       # steps timed so far
        self.when: dict[int, int] = {}       # N -> `timed` at its last time
        self._fresh: tuple[int, dict[int, float]] = (-1, {})  # (timed, fresh()) as last made
        self.curve: dict[int, float] = {}    # N -> seconds of a one-row forward (shape only)
        self.head: dict[int, float] = {}     # n -> seconds of the final norm and LM head over n positions

    def shape(self, n: int) -> float:
        """The cost curve at n, linear between its points and beyond its ends."""
        if len(self.curve) < 2:
            return 1.0 + self.prior_slope * (n - 1)
        return _along(self.curve, n)

    def estimate(self, n: int) -> float:
        """t(n): measured, else interpolated along the curve's shape between the measured sizes
        around n (scaled from the nearest one past either end); never below a measured t(m) for
        m < n: a pass that feeds more tokens does no less work, so a longer step timed faster than
        a shorter one is noise. t therefore never falls as n grows (scaling from the nearest size
        alone fell at the midpoint between two: t(4) > t(5) from t(1) and t(8)), which, once an
        engine has measured many sizes, would make drafts with no expected gain look free. Only
        sizes timed in the last STALE steps count as measured."""
        measured = self.fresh()
        if not measured:
            return self.shape(n)
        if n in measured:
            value = measured[n]
        else:
            lo = max((m for m in measured if m < n), default=None)
            hi = min((m for m in measured if m > n), default=None)
            if lo is None or hi is None:
                near = hi if lo is None else lo
                value = measured[near] * self.shape(n) / self.shape(near)
            else:
                s_lo, s_hi = self.shape(lo), self.shape(hi)
                w = (self.shape(n) - s_lo) / (s_hi - s_lo) if s_hi != s_lo else (n - lo) / (hi - lo)
                value = measured[lo] + (measured[hi] - measured[lo]) * min(max(w, 0.0), 1.0)
        return max([value, *(t for m, t in measured.items() if m < n)])

    def fresh(self) -> dict[int, float]:
        """The sizes timed in the last STALE steps, and their times (made once per step timed: the
        policy asks for many estimates a step)."""
        if self._fresh[0] != self.timed:
            self._fresh = (self.timed, {n: t for n, t in self.step_s.items() if self.timed - self.when[n] < STALE})
        return self._fresh[1]

    def observe(self, n: int, seconds: float) -> None:
        """A step feeding n tokens took `seconds`: smoothed into t(n), or in its place where t(n)
        is stale (not timed in STALE steps) or new."""
        self.step_s[n] = smoothed(self.step_s.get(n) if n in self.fresh() else None, seconds)
        self.timed += 1
        self.when[n] = self.timed

    def retime(self, n: int, seconds: float) -> None:
        """t(n) measured again after long unmeasured: the new time replaces what was (the rows'
        context has grown since), where observe() would move it a fifth of the way."""
        self.step_s[n] = seconds
        self.timed += 1
        self.when[n] = self.timed

    def seed(self, median_s: dict[int, float], head_s: dict[int, float] | None = None) -> None:
        """Take the shape of a measured forward-cost curve (engine.cost.measure_forward_cost), never
        falling as q grows: a pass that feeds more tokens does no less work (estimate's rule), and a
        dip in the measurement (a mixture of experts' curve can show t(5) < t(4)) would otherwise
        price the longer draft as the cheaper one. head_s: the LM head's part of it, by the same rule."""
        self.curve = _rising(median_s)
        self.head = _rising(head_s or {})

    def head_cost(self, n: int) -> float:
        """The LM head over n positions, in any unit (only ratios are read): linear between the
        measured points and beyond their ends, else HEAD_PRIOR + n."""
        return HEAD_PRIOR + n if len(self.head) < 2 else _along(self.head, n)


def _along(curve: dict[int, float], n: int) -> float:
    """A curve of at least two points at n: linear between them, its end segments continued."""
    points = sorted(curve)
    lo = max([p for p in points if p <= n] or points[:1])
    hi = min([p for p in points if p > lo] or points[-1:])
    if hi == lo:  # past the last point: continue the last segment
        lo, hi = points[-2], points[-1]
    return max(curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo), 1e-9)


def _rising(measured: dict[int, float]) -> dict[int, float]:
    """A measured curve by its points in order, each at least the one before."""
    points = sorted(measured)
    return dict(zip(points, accumulate((measured[p] for p in points), max)))


@dataclass(frozen=True)
class RowDraft:
    available: int              # draft tokens the row's proposer offers this step
    accept_probs: Sequence[float] | None  # per token, the estimate it is accepted if the ones
                                          # before are; None = no estimate
    pinned: bool                # verify all `available`: the row's draft lengths must not depend
                                # on timing or on other rows (seeded sampling, adaptive off)
    as_walked: bool = True      # its positions may be scored only as far as the walk reaches
                                # (engine/scores.py): a chain whose proposer reads no top tokens

    @classmethod
    def of(cls, draft: Draft, pinned: bool) -> RowDraft:
        """A draft tree as the policy reads it: a prefix of its nodes is verified, and node i's
        chance of being reached and accepted is the product of the estimates along its path,
        capped by node i-1's (so the chances fall along the node order, as along a chain)."""
        probs = draft.accept_probs
        if probs is None or draft.is_chain:
            return cls(len(draft.tokens), probs, pinned, draft.is_chain and not draft.scored_whole)
        path: list[float] = []  # per node, the product along its path
        chained, before = [], 1.0
        for parent, a in zip(draft.tree, probs):
            path.append(a * (path[parent] if parent >= 0 else 1.0))
            reach = min(path[-1], before)
            chained.append(reach / before if before > 0 else 0.0)
            before = reach
        # a tree's walk can leave its first positions through any branch: it is scored whole
        return cls(len(draft.tokens), chained, pinned, False)


def choose_draft_lengths(rows: Sequence[RowDraft], cost: StepCost, policy: PolicyName = "goodput",
                         max_step_tokens: int | None = None) -> list[int]:
    """Draft tokens to verify per row. "fixed" verifies every offered token; "goodput" maximizes
    expected tokens per second, never feeding more than max_step_tokens in one step except for
    pinned rows (their drafts always go in)."""
    lengths = [r.available if r.pinned or r.accept_probs is None or policy == "fixed" else 0
               for r in rows]
    if policy == "fixed":
        return lengths
    fed = len(rows) + sum(lengths)
    # Each candidate is one more draft token of a row: its marginal expected gain a_1...a_j. Gains
    # fall along a row, so taking candidates in descending order (stable) extends every row by a prefix.
    # A token with no expected gain is never a candidate: only noise in the measured step times
    # (a longer step timed faster than a shorter one) could make it look worth feeding.
    candidates = sorted(((gain, b) for b, r in enumerate(rows) if lengths[b] == 0 and r.available
                         for gain in accumulate(r.accept_probs[:r.available], mul) if gain > 0),
                        key=lambda c: -c[0])
    room = len(candidates) if max_step_tokens is None else max(max_step_tokens - fed, 0)
    best, best_rate = best_extension(float(len(rows)), [gain for gain, _ in candidates[:room]],
                                     lambda n: cost.estimate(fed + n))
    if best_rate < (1 + MIN_GAIN) * len(rows) / cost.estimate(fed):
        best = 0
    for _, b in candidates[:best]:
        lengths[b] += 1
    return lengths


def first_scored(reach: Sequence[float], head_cost: Callable[[int], float]) -> int:
    """How many of a row's positions (the root, then its nodes in order) the LM head scores before
    verifying it (engine/scores.py), m of the n+1: the one that minimizes the expected head cost
    head(m) + reach[m-1] * head(n+1-m), where reach[i] is the chance the walk accepts node i (then
    it needs node i's position; with the first m scored, node m-1's is the first it lacks)."""
    n = len(reach)
    return min(range(1, n + 2), key=lambda m: head_cost(m) + (reach[m - 1] * head_cost(n + 1 - m) if m <= n else 0.0))
