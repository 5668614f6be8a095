"""How many prompt tokens one engine step prefills: all while no row decodes; while rows decode,
as many as the measured costs say stall them at most STALL decode steps more (a stream's gap
between tokens is then at most 1 + STALL of its usual steps). The engine also keeps each pass
within `Transformer.invariant_rows`, so a prompt prefilled in chunks, or after a prefix-cache
hit, gives the K/V and logits of a one-pass prefill bitwise.

Knows step costs, nothing of requests or models.
"""
from __future__ import annotations

from quickdraft.engine.policy import StepCost

STALL = 2.0      # a chunk costs at most this many of the running rows' decode steps
MIN_CHUNK = 4    # at least this many tokens a pass, however slow, so a prompt always advances


def step_allowance(decoding: int, step: StepCost, prefill: StepCost, fixed: int | None) -> int | None:
    """Prompt tokens the prefill passes of one engine step may feed; None: no limit (no row decodes,
    so none stalls). decoding: rows decoding this step; step: their steps' t(N); prefill: t(n) of
    prefill passes measured so far; fixed: the chunk size asked for."""
    if fixed is not None:
        return fixed
    if decoding == 0:
        return None
    # in one unit: seconds once both are measured, else the decode steps' curve for both
    t = prefill if prefill.step_s and step.step_s else step
    budget = STALL * step.estimate(decoding)
    # at most twice the largest size measured: past it t(n) is extrapolated, and a curve flat or
    # falling at its end (noise; a memory-bound GPU) would call any chunk cheap
    lo, hi = MIN_CHUNK, 2 * max(t.step_s, default=2 * MIN_CHUNK)
    while lo < hi:  # the largest n with t(n) <= budget (t grows with n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if t.estimate(mid) <= budget else (lo, mid - 1)
    return lo
