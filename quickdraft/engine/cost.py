"""The target's forward cost as a function of q, the tokens fed per pass: t(q) / t(1).

Verifying k drafts feeds q = k+1 tokens; while a pass is memory-bound t(q) barely grows with q,
and the ratio curve says how large k can profitably be on this machine. Reusable (the benchmark
prints it, an adaptive k can measure it at start-up); knows the model's forward, nothing else.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from quickdraft.model.llama import Transformer


@dataclass(frozen=True)
class ForwardCost:
    ratios: dict[int, float]    # q -> median t(q) / median t(1); exactly 1.0 at q = 1
    t1_s: float                 # median seconds of a 1-token pass
    median_s: dict[int, float]  # q -> median seconds of a q-token pass
    context_len: int
    repeats: int
    head_s: dict[int, float]    # q -> median seconds of the pass's final norm and LM head alone (part of
                                # median_s): what scoring fewer positions than q could save


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_forward_cost(model: Transformer, q_values: Iterable[int], context_len: int = 256,
                         repeats: int = 5, warmup: int = 2, seed: int = 0) -> ForwardCost:
    """Time one forward feeding q new tokens at positions context_len..context_len+q-1 over a
    cached context of context_len tokens, for each q (1 is always added). Medians over `repeats`
    rounds; every round times every q (in alternating order, so linear drift cancels)."""
    qs = sorted({1, *(int(q) for q in q_values)})
    if qs[0] < 1:
        raise ValueError(f"q values must be >= 1, found {qs[0]}")
    if context_len < 1 or repeats < 1:
        raise ValueError(f"context_len and repeats must be >= 1, found {context_len}, {repeats}")
    room = model.config.max_position_embeddings
    if context_len + qs[-1] > room:
        raise ValueError(f"context {context_len} + q {qs[-1]} tokens exceed the model's "
                         f"{room} positions; expected context_len + max q <= {room}")
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = model.new_cache(1, context_len + qs[-1])
    context = torch.randint(vocab, (1, context_len), generator=gen).to(device)
    model(context, torch.arange(context_len, device=device)[None], cache, last_n=1)
    cache.truncate([context_len])
    # The same tokens every time per q: rewriting the same cache slots keeps the context fixed.
    feeds = {q: (torch.randint(vocab, (1, q), generator=gen).to(device),
                 torch.arange(context_len, context_len + q, device=device)[None]) for q in qs}

    def one(q: int) -> tuple[float, float]:
        """(the pass, its LM head): the layers, then the head over every fed token, as verify does."""
        tokens, positions = feeds[q]
        _sync(device)
        start = time.perf_counter()
        hidden = model(tokens, positions, cache, last_n=0).hidden
        _sync(device)
        middle = time.perf_counter()
        model.logits(hidden)
        _sync(device)
        end = time.perf_counter()
        return end - start, end - middle

    for _ in range(warmup):
        for q in qs:
            one(q)
    times: dict[int, list[tuple[float, float]]] = {q: [] for q in qs}
    for r in range(repeats):
        for q in (qs if r % 2 == 0 else reversed(qs)):
            times[q].append(one(q))
    median = {q: statistics.median(t for t, _ in ts) for q, ts in times.items()}
    head = {q: statistics.median(h for _, h in ts) for q, ts in times.items()}
    t1 = median[1]
    return ForwardCost({q: median[q] / t1 for q in qs}, t1, median, context_len, repeats, head)
