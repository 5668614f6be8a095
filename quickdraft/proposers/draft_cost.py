"""When a draft model's forwards pay: how many tokens to draft, per row and step, from their cost.

A draft model is not free on a CPU (the Qwen 0.5B's forward costs ~0.46 of its 1.5B target's), and
its tokens are spent before the engine's policy chooses what to verify. So the drafter weighs each
draft forward itself, as the policy weighs verification (engine/policy.py): a step with B rows
commits E tokens in expectation in C seconds; one more draft level for rows S adds
sum_{b in S} g_b expected tokens (g_b: the chance that row b's next draft token is reached and
accepted) and costs the level's forward plus |S| verified tokens. The level runs only if it
raises E / C. A large batch (verification compute-bound) or an unsure draft thus drafts little or
nothing, and speculation never costs more than it is expected to win.

Both rates are goodput.py's E / C. Acceptance is learned, not assumed: for greedy rows the draft's own probability of its token is
mapped to the acceptance measured at that confidence (`Calibration`, shared by a draft model's
requests), like llama.cpp's p_min but calibrated. A token not drawn yet, and every token of a
sampled row, is priced at its request's own acceptance so far over the mean of all (`expected`):
an estimate read from a drawn token (its q(x)) would decide whether that token is verified, which
biases the law; one that depends on the past only does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from quickdraft.spec.draft_contract import PassCost
from quickdraft.spec.goodput import Acceptance, best_extension, smoothed

if TYPE_CHECKING:
    from quickdraft.proposers.draft_rows import DraftRow, Member

BINS = 20          # confidence bins of the calibration
PRIOR_WEIGHT = 2.0  # pseudo-observations per bin at its own confidence (an uncalibrated draft's guess)
CATCH_UP = 4       # tokens a row may catch up on inside the batched forward; more run alone first
EXPLORE = 16       # steps a row may go without drafting before it drafts once anyway (if a level
                   # could pay at the best acceptance measured): acceptance changes with the text,
                   # and a row that never drafts never learns it has
OWN_WEIGHT = 8.0   # a request's verified draft tokens that weigh as much as the mean of all requests
OWN_WINDOW = 32.0  # the draft tokens a request's own record holds, older ones fading (Acceptance.recent):
                   # after a run of rejections a few accepted explorations let it draft again


class Calibration:
    """P(a draft token is accepted | its parent was, the draft's confidence in it): an Acceptance
    per confidence bin, each starting at its own confidence."""

    def __init__(self) -> None:
        self.bins = [Acceptance(PRIOR_WEIGHT * (i + 0.5) / BINS, PRIOR_WEIGHT) for i in range(BINS)]
        self.accepted = self.verified = 0  # every token recorded, whatever its bin: the mean's evidence

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * BINS), 0), BINS - 1)

    def estimate(self, confidence: float) -> float:
        return self.bins[self._bin(confidence)].rate

    @property
    def best(self) -> float:
        """The acceptance of the most accepted confidence bin: the most a draft token can be
        expected to win, whatever the text."""
        return max(b.rate for b in self.bins)

    @property
    def mean(self) -> float:
        """Acceptance over all confidences, what a request's own record starts from (`expected`): what was
        recorded, after one prior of PRIOR_WEIGHT trials at 1/2. (Summing the bins counted their 20
        priors, 40 trials, against the evidence: 11 accepted tokens of 11 read 0.61, and a draft
        model priced just above that stopped drafting for good, learning nothing more: the 0.5B
        at k = 8 on HumanEval, 87% accepted where it drafted.)"""
        return (self.accepted + PRIOR_WEIGHT / 2) / (self.verified + PRIOR_WEIGHT)

    def record(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        """A chain's outcome: its first `verified` tokens were verified, the first `accepted` of
        them accepted; a token after the first rejected one tells nothing."""
        for i, c in enumerate(confidences[:min(verified, accepted + 1)]):
            self.bins[self._bin(c)].record(i < accepted)
            self.accepted += i < accepted
            self.verified += 1


def expected(calibration: Calibration, s: DraftRow) -> float:
    """The chance that a draft token of s's member not drawn yet is accepted, its parent being: its
    request's own record over the mean of every request's, counted as OWN_WEIGHT tokens. The text
    decides: the Qwen 0.5B drafting for the 1.5B was accepted 84-92% of the time in Spec-Bench's
    mt_bench, math and code edits and 63-70% in translation and qa, where a draft token at ~0.47 of
    a target pass does not pay; priced at the mean of all requests, it drafted there at 0.83-0.88x
    plain (docs/notes/qwen-pair.md)."""
    return s.record.toward(Acceptance(calibration.mean, 1.0), OWN_WEIGHT)


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
        return best_extension(self.expected, [gain], self._seconds(level_s, per_token))[0] == 1

    def _seconds(self, level_s: float, per_token: float) -> Callable[[int], float]:
        """seconds(n): the step's with the level run and n more tokens verified (none: not run)."""
        return lambda n: self.seconds + level_s + per_token * n if n else self.seconds

    def extend(self, forced: Sequence[float], gains: Sequence[float], level_s: float, per_token: float) -> int:
        """Add a draft level: the rows of `forced` draft whatever it costs (their lengths must not
        depend on timing, or they explore), of the others those with the largest `gains` (sorted,
        largest first) that raise E / C most: -> how many of `gains` go (0: none pays)."""
        self.expected += sum(forced)
        self.seconds += (level_s if forced else 0.0) + per_token * len(forced)
        level_s = 0.0 if forced else level_s  # paid already: the others add only their verification
        best, _ = best_extension(self.expected, gains, self._seconds(level_s, per_token))
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
    step_s, seconds = [cost.seconds], cost.seconds + first_s - later_s  # step_s[i]: with a chain of i
    for _ in range(k):
        seconds += later_s + cost.per_token
        step_s.append(seconds)
    _, rate = best_extension(1.0, [acceptance ** i for i in range(1, k + 1)], step_s.__getitem__)
    return remaining * (cost.seconds - 1 / rate) > catch_up_s


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
        setattr(self, kind, smoothed(getattr(self, kind), seconds))


def explores(s: DraftRow) -> bool:
    """Whether the member of state s drafts on the hope of the best acceptance measured: after
    EXPLORE idle steps, once the draft has its prompt (a prompt is prefilled only where drafting
    pays at the expected acceptance: explorations that prefilled chat prompts cost a server with the Qwen pair 3%
    at one request at a time, and found nothing to draft)."""
    return s.idle >= EXPLORE and s.cached > 0


def catching_up_pays(m: Member, s: DraftRow, k: int, calibration: Calibration, times: ForwardTimes,
                     reusable: Callable[[], int]) -> bool:
    """A row behind by more than CATCH_UP tokens (its prompt, or text committed while it did
    not draft) drafts only if drafting can repay the catch-up over the rest of its request
    (catch_up_pays) at the acceptance that let it draft: its expected one (`expected`), or for a
    row exploring the best measured (explores). The catch-up is what the prefix cache cannot give (a resent
    chat history: the new turn; `reusable()`: how many of its tokens the row can hold without
    running them). Rows whose lengths must not depend on timing, and rows before anything is
    timed, always do."""
    if len(m.tokens) - s.cached <= CATCH_UP or m.cost is None or None in (times.catch_up, times.first):
        return True
    later = times.later if times.later is not None else times.first
    acceptance = calibration.best if explores(s) else expected(calibration, s)
    return catch_up_pays(m.cost, acceptance, k, times.first, later, m.horizon - len(m.tokens),
                         times.catch_up * (len(m.tokens) - reusable()))


def worth(rows: list[int], members: Sequence[Member], states: Sequence[DraftRow], gains: list[float],
          calibration: Sequence[Calibration], plan: Plan | None, per_token: float, level_s: float | None,
          first: bool = False) -> list[int]:
    """Which of `rows` draft one more token: all of them while their lengths
    must not depend on timing (no plan); while the level's cost is not measured yet, those that
    cannot choose, or else one; then the rows that cannot choose (a pass cost of None), rows
    exploring (explores) where a level could pay at the best acceptance measured (where none
    could, as on a CPU whose verification of k tokens costs k passes, exploring is a loss: its
    catch-up forward is not repaid), and those of the others whose expected gains pay for the
    level."""
    if plan is None:
        return rows
    if level_s is None:  # rows that cannot choose draft; else one row measures the level first,
        # the one with least to catch up: a server's first wave would otherwise prefill every
        # prompt in the draft, for drafts that may not pay at its batch size
        must = [b for b in rows if members[b].cost is None]
        return must or sorted(rows, key=lambda b: len(members[b].tokens) - states[b].cached)[:1]
    forced = [b for b in rows if members[b].cost is None
              or (first and explores(states[b]) and plan.pays(calibration[b].best, level_s, per_token))]
    # the next token's chance: reached (gains) and accepted at a confidence not known before it is drawn
    chance = {b: gains[b] * expected(calibration[b], states[b]) for b in rows}
    optional = sorted((b for b in rows if b not in forced), key=lambda b: -chance[b])
    n = plan.extend([chance[b] for b in forced], [chance[b] for b in optional], level_s, per_token)
    return sorted(forced + optional[:n])
