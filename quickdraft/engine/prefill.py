"""Which waiting prompt is admitted next, and how many prompt tokens one engine step prefills.

Admission: the prompt with the fewest tokens left to prefill once its cached prefix is copied in
(shortest remaining first: sessions arriving together behind a shared system prompt each wait for
the short remainders before theirs, not for whichever long one came first), unless one has been
passed over PASSED_OVER times: then the oldest such goes first, so none waits forever.

Prefill: all while no row decodes; while rows decode,
as many as stall them at most STALL decode steps more (a stream's gap between tokens is then at
most 1 + STALL of its usual steps). The engine also keeps each pass within
`Transformer.invariant_rows`, so a prompt prefilled in chunks, or after a prefix-cache hit, gives
the K/V and logits of a one-pass prefill bitwise.

A chunk's cost is read off the last prefill pass, not a curve: it depends on the prompt's context
(attention over every cached token) as much as on its size, and a curve measured on whole prompts
or on another context misjudged it by 10x (a 1,900-token prompt's pass made every chunk after a
prefix hit look so slow that prompts advanced 4 tokens a step).

Knows step costs, nothing of requests or models.
"""
from __future__ import annotations

from quickdraft.engine.policy import StepCost

STALL = 0.75     # a chunk costs at most this many of the running rows' decode steps: a stream's gap
                 # stays within 3 of its steps with room to spare, as chunk costs are estimated from
                 # the last pass (a pass's time varies by a fifth on a busy CPU), the context grows
                 # under them, and a step now and then takes one usual step more for no reason of
                 # ours (the machine). On the 1.5B with a 4,000-token prompt: 1.5 let 3-5% of the
                 # gaps past 3x; 1.25: p99 2.7-2.9x, a gap in 1,000 past it (worst 3.3-4.1x); 1.0:
                 # p99 2.3-2.5x, worst 2.7-3.1x; 0.75: p99 2.1-2.5x, worst 2.6-2.9x. The price: the
                 # prompt's own prefill beside a stream, (1 + STALL) / STALL of its work
MIN_CHUNK = 1    # at least this many tokens a pass, however slow, so a prompt always advances: late in
                 # a long prompt one token's attention costs half a decode step of the 1.5B (4 tokens
                 # at 4,000 took 2.3 steps more)
PASSED_OVER = 4  # admissions a waiting prompt may be passed over for shorter ones before it goes first
GROWTH = 2.0     # a chunk at most this many times the last one: a size's cost is known only near
                 # the last size measured
RETIME = 16      # steps: while a prompt fills beside them, the decoding rows are timed alone (their
                 # step without a chunk) at least this often. A chunk's cost is what it adds to their
                 # step's estimate, which is measured only in steps without one: it went stale while
                 # prompts kept filling (it still said what the rows cost at a shorter context, or
                 # fewer of them), the rows' own attention was charged to the chunks, and chunks
                 # shrank to a few tokens a step (8 sessions behind a 1,500-token system prompt on
                 # the 1.5B: a 67-token remainder took 6 s beside 3 streams)


def step_allowance(decoding: int, step: StepCost, last: tuple[int, float] | None, fixed: int | None,
                   untimed: int = 0) -> int | None:
    """Prompt tokens the prefill passes of one engine step may feed; None: no limit (no row decodes,
    so none stalls). decoding: rows decoding this step; step: their steps' t(N); last: (tokens,
    seconds) of the last prefill pass; fixed: the chunk size asked for; untimed: steps since the
    decoding rows were last timed alone (at RETIME, none: this step times them)."""
    if fixed is not None:
        return fixed
    if decoding == 0:
        return None
    if untimed >= RETIME:
        return 0
    if last is None:
        return MIN_CHUNK
    n, seconds = last
    # Scaled to the budget in proportion: a pass's cost grows at most linearly in its tokens (less
    # while reading the weights dominates), so this errs small and the next pass corrects it.
    fit = int(n * STALL * step.estimate(decoding) / max(seconds, 1e-9))
    return max(MIN_CHUNK, min(fit, int(GROWTH * n)))


def next_admitted(left: list[int], passed: list[int]) -> int:
    """Index of the waiting prompt to admit: left[i] its tokens still to prefill, passed[i] how often
    it was passed over (both in arrival order)."""
    overdue = [i for i, n in enumerate(passed) if n >= PASSED_OVER]
    if overdue:
        return overdue[0]
    return min(range(len(left)), key=lambda i: left[i])  # the first of equals: arrival order
