"""Goodput: expected committed tokens per second, the one model every speculation choice asks.

A step that commits E tokens in expectation in C seconds runs at E / C; drafting one more token
whose chance of being reached and accepted is g adds g to E and its cost to C. The engine's policy
(engine/policy.py: which drafted tokens to verify, C from the measured step cost t(N)) and a draft
model's drafter (proposers/draft_cost.py: which draft forwards to run, C from the pass cost the
engine tells it plus the measured forward times) both pick the extension with the best E / C here
(`best_extension`), over times smoothed the same way (`smoothed`). The g's come from acceptance
counts (`Acceptance`), kept by every proposer that estimates its own acceptance.
Knows no model, engine or proposer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from quickdraft.spec.sequences import common_prefix

EMA = 0.2  # weight of a new time measurement (the engine's step times, a drafter's forwards)


def smoothed(old: float | None, seconds: float) -> float:
    """An exponential moving average of measured seconds; the first measurement as it is."""
    return seconds if old is None else (1 - EMA) * old + EMA * seconds


def best_extension(expected: float, gains: Sequence[float], seconds: Callable[[int], float]) -> tuple[int, float]:
    """A step expected to commit `expected` tokens in seconds(0); taking the first n of `gains`
    (largest first) adds them to it and takes seconds(n): -> the n with the best tokens per second
    (the smallest such n on ties; 0 when no extension beats the step as it is) and that rate."""
    best, best_rate = 0, expected / seconds(0)
    for n, gain in enumerate(gains, 1):
        expected += gain
        rate = expected / seconds(n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


def agreement(proposal: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """A proposal judged against the committed text: (accepted, judged), its leading tokens the text
    has, and those plus the first that differs (where both go on: a token past the first rejection,
    or past the text, tells nothing). For a greedy row exactly the verifier's verdict; it also judges
    tokens the engine chose not to verify."""
    accepted = common_prefix(proposal, committed)
    return accepted, accepted + (accepted < min(len(proposal), len(committed)))


@dataclass
class Acceptance:
    """How often a kind of draft token is accepted when its parent is: `hits` of `trials`, both
    starting at pseudo-counts (by default 1 of 3: a third before any evidence)."""
    hits: float = 1.0
    trials: float = 3.0

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    def record(self, hits: float, trials: float = 1.0) -> None:
        self.hits += hits
        self.trials += trials

    def recent(self, window: float) -> None:
        """Scale the record down to `window` trials where it holds more: older verdicts fade, as a
        text's acceptance changes while it goes on."""
        if self.trials > window:
            self.hits, self.trials = self.hits * window / self.trials, window

    def judge(self, proposal: Sequence[int], committed: Sequence[int]) -> None:
        """Count a proposal's tokens against the committed text (`agreement`)."""
        self.record(*agreement(proposal, committed))

    def toward(self, prior: Acceptance, weight: float) -> float:
        """This record's rate with `prior`'s rate counted as `weight` observations before it (a
        request's own record over the rate of every request)."""
        return (self.hits + weight * prior.hits / prior.trials) / (self.trials + weight)
