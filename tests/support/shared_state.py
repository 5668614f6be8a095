"""Proposers whose state is shared by a target's requests (recycle, suffix): the target that holds
it, and greedy decoding through it equal to plain, alone and batched (test_recycle's)."""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

from quickdraft.engine.batch import EngineConfig
from quickdraft.model.llama import Transformer
from support.engine import JOBS, run_batched, target


class Home:
    """A Target around a tiny model: its shared state, as quickdraft.LLM keeps it (LLM.shared)."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.name, self.state = model, None, {}

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self.state:
            self.state[key] = make()
        return self.state[key]


def assert_alone_greedy_equals_plain(make: Callable, k: int) -> None:
    """Each of JOBS alone, twice through one shared state (cold, then warm), the K/V checked every
    step: its tokens are plain greedy's; drafts were accepted."""
    model = target()
    accepted = 0
    for _ in range(2):
        for job in JOBS:
            out, last, violations = run_batched(model, [replace(job, make=make, k=k, join_at=0)],
                                                EngineConfig(max_batch=1, policy="fixed"))
            assert violations == []
            assert out["0"] == replace(job, make=None, k=0).alone(model)
            accepted += last["0"].stats.accepted_tokens
    assert accepted > 0


def assert_batched_greedy_equals_plain(make: Callable, k: int, policy: str) -> None:
    """JOBS in a batch of 3 (rows join, finish, wait, stop), twice through one shared state (cold,
    then warm): every request's tokens are plain greedy's; drafts were accepted."""
    model = target()
    jobs = [replace(job, make=make, k=k) for job in JOBS]
    plain = [replace(job, make=None, k=0).alone(model) for job in JOBS]
    for _ in range(2):
        out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=3, policy=policy))
        assert violations == []
        assert [out[str(i)] for i in range(len(jobs))] == plain
    assert sum(ev.stats.accepted_tokens for ev in last.values()) > 0
