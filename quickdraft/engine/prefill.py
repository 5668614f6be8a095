"""How much of a prompt one prefill pass feeds: whole while no row decodes; while rows decode, the
largest chunk whose measured cost stalls them at most STALL decode steps more (a stream's gap
between tokens is then at most 1 + STALL of its usual steps); never more rows than keep every
row's result bitwise what it is in any other pass (`invariant_rows`), so a prompt prefilled in
chunks, or after a prefix-cache hit, gives the K/V and logits of a one-pass prefill.

Knows step costs and kernels' limits, nothing of requests.
"""
from __future__ import annotations

from quickdraft import kernels
from quickdraft.engine.policy import StepCost
from quickdraft.kernels import QuantizedWeight
from quickdraft.model.llama import Transformer

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
    lo, hi = MIN_CHUNK, 1 << 16
    while lo < hi:  # the largest n with t(n) <= budget (t grows with n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if t.estimate(mid) <= budget else (lo, mid - 1)
    return lo


def invariant_rows(model: Transformer) -> int | None:
    """Rows one pass may feed with each row's result independent of the others: the C kernel over
    float matrices takes up to kernels.MAX_ROWS (torch's GEMM, which takes more, blocks its sums by
    the row count); over GGUF blocks any count. None: no limit (every matrix is as stored, or the C
    kernels do not run here, which makes no pass batch-invariant anyway)."""
    if model.device.type != "cpu" or kernels.active_library() is None:
        return None
    blocks = [getattr(block, name).weight for block in model.blocks for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    return None if all(isinstance(w, QuantizedWeight) for w in blocks) else kernels.MAX_ROWS
