"""What a process that runs a model's engine sets up first, the same for `quickdraft serve`, each
replica of a cluster (cluster/replica.py), `bench serve` and every other command: torch's CPU
threads before the model loads (the kernels and the engine read them from then on), and the
goodput policy's step-time model seeded with this machine's forward-cost curve (and its LM head's,
which says how many positions verification scores first: engine/scores.py).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from quickdraft.engine.policy import StepCost
from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.api import LLM

COST_Q = (2, 4, 8, 16, 32, 64)  # the forward-cost points measured at start-up
THREADS_PER_CPU = 4  # --threads at most


def set_threads(threads: int | None) -> None:
    """torch's CPU threads (None: torch's choice), at most THREADS_PER_CPU a CPU: far more could not
    be started (the tokenizer's pool then panics), and would only take turns."""
    if threads is not None:
        cpus = os.cpu_count() or 1
        if not 1 <= threads <= THREADS_PER_CPU * cpus:
            raise QuickdraftError(f"--threads must be in 1..{THREADS_PER_CPU * cpus} ({THREADS_PER_CPU} a CPU, "
                                  f"{cpus} here), found {threads}")
        import torch
        torch.set_num_threads(threads)


def startup_cost(llm: LLM, policy: str, measure: bool) -> StepCost:
    """The goodput policy's step-time model, seeded with this machine's forward-cost curve."""
    from quickdraft.engine.cost import measure_forward_cost
    cost = StepCost()
    context = min(256, llm.model.config.max_position_embeddings - max(COST_Q))
    if policy == "goodput" and measure and context > 0:
        print("quickdraft: measuring the forward-cost curve for the draft-length policy...", file=sys.stderr)
        measured = measure_forward_cost(llm.model, COST_Q, context_len=context, repeats=3)
        cost.seed(measured.median_s, measured.head_s)
    return cost


def start_serving(threads: int | None, load: Callable[[], LLM], policy: str, measure: bool) -> tuple[LLM, StepCost]:
    """A serving process's start (`quickdraft serve`, a cluster's replica, `bench serve`), in its
    order: the threads, then the model (`load`), then its step-time model."""
    set_threads(threads)
    llm = load()
    return llm, startup_cost(llm, policy, measure)
