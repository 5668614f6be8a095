"""Engine runs for the tests: jobs, proposer factories, batched runs with their checks."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.loop import generate_tokens
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, Committed, Draft, Proposer
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.draft_rows import DraftRow
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.laws import N_TOKENS
from support.models import KV_TOL, V16, kv_mismatch, tiny

MODEL = "llama-gqa-untied"


def target() -> Transformer:
    return tiny(MODEL, init=0.1)  # varied text with loops in it: n-gram drafts hit and miss


def ngram(prompt: Sequence[int], params: SamplingParams) -> Proposer:
    return NgramProposer(prompt, 4, 1)


@functools.lru_cache(maxsize=None)
def drafter(seed: int) -> Drafter:
    """One per draft model, as the target's shared state holds it: its requests draft together."""
    return Drafter(tiny(MODEL, init=0.1) if seed == 0 else tiny(MODEL, seed=seed))


def draft_same(prompt: Sequence[int], params: SamplingParams) -> Proposer:
    return DraftModelProposer(drafter(0), prompt, params, len(prompt) + params.max_new_tokens + 9)


def draft_random(prompt: Sequence[int], params: SamplingParams) -> Proposer:
    return DraftModelProposer(drafter(1), prompt, params, len(prompt) + params.max_new_tokens + 9)


ProposerFactory = Callable[[Sequence[int], SamplingParams], Proposer] | None


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    make: ProposerFactory
    k: int
    join_at: int = 0  # engine step before which the request is added

    def request(self, rid: str) -> Request:
        proposer = self.make(self.prompt, self.params) if self.make else None
        return Request(self.prompt, self.params, frozenset(), proposer, self.k, id=rid)

    def alone(self, model: Transformer) -> list[int]:
        proposer = self.make(self.prompt, self.params) if self.make else None
        return [t for ev in generate_tokens(model, self.prompt, self.params, frozenset(), proposer, self.k)
                for t in ev.token_ids]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


JOBS = [
    Job([1, 17, 42, 8, 77, 23], greedy(30), None, 0),
    Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(40), ngram, 8),
    Job([3, 3, 4, 5, 3, 3, 4], greedy(12), ngram, 4, join_at=2),        # finishes early: rows move
    Job([9, 2, 9, 2, 9, 2, 9], greedy(35), draft_same, 3, join_at=1),
    Job([44, 12, 19], greedy(25), draft_random, 2, join_at=3),
    Job([7, 1, 7, 1, 7, 1, 7, 1, 7, 1], greedy(30), ngram, 1, join_at=5),  # waits for a free row
    Job([8, 8, 8, 8], greedy(20, stop_token_ids=(29,)), ngram, 4, join_at=6),  # stops on a token
]


OUT_OF_VOCAB = 10**6  # a token id no tiny model has: the target's pass raises on it (index error)


def drive(engine: Engine, jobs: Sequence[Job], after: Callable[[Engine, list], None] = lambda engine, events: None,
          limit: int = 1000) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Adds each job (request id: its index) before its join_at step and steps the engine until all
    are done, `after(engine, events)` each step; tokens and cached prompt tokens per request id."""
    out: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    cached: dict[str, int] = {}
    step = 0
    while step <= max(job.join_at for job in jobs) or engine.has_work():
        for i, job in enumerate(jobs):
            if job.join_at == step:
                engine.add(job.request(str(i)))
        events = engine.step()
        for rid, event in events:
            assert event.error is None, event.error
            out[rid] += event.token_ids
            cached[rid] = event.stats.cached_tokens
        after(engine, events)
        step += 1
        assert step < limit
    return out, cached


def run_batched(model: Transformer, jobs: Sequence[Job], config: EngineConfig, check_kv: bool = True,
                on_step: Callable[[Engine, int], None] | None = None) -> tuple[dict[str, list[int]], dict, list[str]]:
    """Runs jobs through one engine; returns tokens and last events per request id and a list of
    cache violations (each running row's length and K/V checked against a fresh forward)."""
    engine = Engine(model, config)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    last: dict[str, object] = {}
    violations: list[str] = []
    step = 0
    while step == 0 or engine.has_work() or any(j.join_at >= step for j in jobs):
        for i, job in enumerate(jobs):
            if job.join_at == step:
                engine.add(job.request(str(i)))
        if on_step:
            on_step(engine, step)
        for rid, event in engine.step():
            out[rid] += event.token_ids
            last[rid] = event
        for index, row in enumerate(engine.rows):
            rid = row.request.id
            if last[rid].finish_reason == "error":  # ended: its cache is no one's any more
                continue
            seq = jobs[int(rid)].prompt + out[rid]
            expected = len(seq) - (0 if last[rid].finish_reason == "stop" else 1)
            if engine.cache.lengths[index] != row.length or row.length != expected:
                violations.append(f"step {step} row {rid}: cache {engine.cache.lengths[index]}, "
                                  f"row {row.length}, expected {expected}")
            if check_kv and (diff := kv_mismatch(model, engine.cache.rows(index, index + 1), seq[:row.length])) > KV_TOL:
                violations.append(f"step {step} row {rid}: K/V differ by {diff:.3g}")
        step += 1
        assert step < 500
    return out, last, violations


def first_tokens_in_batches(model: Transformer, requests: Sequence[Request], n: int = N_TOKENS
                            ) -> tuple[torch.Tensor, int, int]:
    """Runs the requests through one engine, 8 rows at a time: counts [V16]*n of their first n
    tokens, and the drafted and accepted tokens in all. Prompts are admitted with a fixed prefill
    allowance, so that rows decode side by side whatever the machine's step times (measured ones
    would stagger them, and the premises of batched drafting with them)."""
    engine = Engine(model, EngineConfig(max_batch=8, prefill_chunk=256))
    for request in requests:
        engine.add(request)
    counts = torch.zeros([V16] * n, dtype=torch.long)
    ids: dict[str, list[int]] = {}
    drafted = accepted = 0
    while engine.has_work():
        for rid, event in engine.step():
            ids.setdefault(rid, []).extend(event.token_ids)
            if event.finish_reason:
                counts[tuple(ids[rid][:n])] += 1
                drafted += event.stats.drafted_tokens
                accepted += event.stats.accepted_tokens
    return counts, drafted, accepted


def draft_state(m: DraftModelProposer) -> DraftRow:
    """The drafter's state of m (draft_rows.py); before m's first draft a blank one (nothing cached)."""
    return m.group.rows.of(m) or DraftRow(row=-1)


class Checked:
    """Wraps a proposer: records every proposal, and for a DraftModelProposer checks its own cache
    after each commit (violations are collected, so a test first reports what the user sees)."""
    group = EACH

    def __init__(self, inner: Proposer, prompt: Sequence[int]) -> None:
        self.inner = inner
        self.seq = list(prompt)
        self.proposals: list[list[int]] = []
        self.violations: list[str] = []

    def propose(self, k: int) -> Draft:
        draft = self.inner.propose(k)
        if len(draft.tokens) > k:
            self.violations.append(f"proposed {len(draft.tokens)} tokens for k={k}")
        self.proposals.append(list(draft.tokens))
        return draft

    def commit(self, step: Committed) -> None:
        self.inner.commit(step)
        self.seq += step.tokens
        inner = self.inner
        if not isinstance(inner, DraftModelProposer):
            return
        where = f"after committing {len(self.seq)} tokens"
        if inner.tokens != self.seq:
            self.violations.append(f"{where}: proposer.tokens is not the committed sequence")
        cached = draft_state(inner).cached
        if inner.cache.lengths[0] != cached:
            self.violations.append(f"{where}: cache length {inner.cache.lengths[0]} != cached {cached}")
        # The newest token is the target's: the draft has not run it yet.
        if inner.cache.lengths[0] > len(self.seq) - 1:
            self.violations.append(f"{where}: draft cache holds {inner.cache.lengths[0]} tokens, "
                                   f"more than the {len(self.seq) - 1} committed before the newest")
        diff = kv_mismatch(inner.model, inner.cache, self.seq[:cached])
        if diff > KV_TOL:
            self.violations.append(f"{where}: the draft cache's first {cached} slots differ from "
                                   f"a fresh forward over those tokens by {diff:.3g}")
