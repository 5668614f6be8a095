"""Batched drafting: the requests drafting with one draft model share its Drafter, whose every
draft step is one forward for all their rows, and each still decodes exactly as plain decoding.

Oracles: plain greedy decoding of each prompt alone (token for token); seeded sampled requests
alone (the same tokens inside any batch); each member's draft-cache row against a fresh forward
over the tokens it claims; the exact law of the first sampled tokens (chi-square, false failure
1e-6) with a negative control the same test must reject; the forwards' row counts as premises.
"""
from __future__ import annotations

import gc
from typing import Sequence

import pytest

import quickdraft
import quickdraft.engine.rows as engine_rows
import quickdraft.engine.scheduler as engine_scheduler
import quickdraft.proposers.draft_chain as draft_chain
import quickdraft.proposers.draft_cost as draft_cost
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.loop import generate_tokens
from quickdraft.proposers.base import NO_DRAFT, Committed, Draft, Each, Proposer, SpecConfig
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.drafts import Counted, first_tokens, noisy_draft
from support.engine import Job, draft_state, greedy, run_batched, target
from support.laws import (
    ALPHA,
    N_SAMPLES,
    N_TOKENS,
    PROMPT16,
    assert_plain_sampling_law,
    chi_square_p_value,
    plain_law,
)
from support.models import KV_TOL, kv_mismatch, tiny16, tiny16_draft
from tiny_tokenizer import tiny_llm_dir


def member(drafter: Drafter, violations: list[str]):
    def make(prompt: Sequence[int], params: SamplingParams) -> Proposer:
        proposer = DraftModelProposer(drafter, prompt, params, len(prompt) + params.max_new_tokens + 9)
        commit = proposer.commit

        def checked_commit(step: Committed) -> None:
            commit(step)
            state = draft_state(proposer)
            seq = proposer.tokens[:state.cached]
            if proposer.cache.lengths[0] != state.cached:
                violations.append(f"row {state.row}: length {proposer.cache.lengths[0]} != {state.cached}")
            if (diff := kv_mismatch(proposer.model, proposer.cache, seq)) > KV_TOL:
                violations.append(f"row {state.row}: K/V of {len(seq)} tokens differ by {diff:.3g}")
        proposer.commit = checked_commit  # the instance's: the group still calls the real propose
        return proposer
    return make


def jobs(make) -> list[Job]:
    """Ragged prompts and ks, rows joining (one waits for a free row of 3) and leaving early."""
    return [
        Job([1, 17, 42, 8, 77, 23], greedy(30), make, 4),
        Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(12), make, 8, join_at=1),
        Job([44, 12, 19], greedy(25), make, 2, join_at=1),
        Job([9, 2, 9, 2, 9, 2, 9, 3, 30, 31, 32], greedy(28), make, 6, join_at=2),   # waits
        Job([7, 1, 7], greedy(20, stop_token_ids=(29,)), make, 3, join_at=4),
        Job([8, 8, 8, 8, 60, 61], greedy(18), lambda p, s: NgramProposer(p, 4, 1), 4, join_at=5),
        Job([3, 4], greedy(22), make, 5, join_at=6),
    ]


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_batched_draft_greedy_equals_plain(policy: str) -> None:
    model = target()
    violations: list[str] = []
    drafter = Counted(noisy_draft())
    batch = jobs(member(drafter, violations))
    out, last, engine_violations = run_batched(model, batch, EngineConfig(max_batch=3, policy=policy))
    assert engine_violations == [] and violations == []
    for i, job in enumerate(batch):
        plain = Job(job.prompt, job.params, None, 0).alone(model)
        assert out[str(i)] == plain, f"request {i} differs from plain greedy"
    # the premises: several rows drafted in one forward, drafts both accepted and rejected, rows reused
    assert max(drafter.rows_per_forward) == 3
    stats = [last[str(i)].stats for i, job in enumerate(batch) if i != 5]  # 5: prompt lookup
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)


def test_batched_draft_seeded_sampling_reproduces_alone() -> None:
    """A seeded request drafts with its own generator: batched, it emits what it emits alone."""
    model = target()
    drafter = Counted(noisy_draft())
    make = member(drafter, [])
    sampled = [Job([5, 6, 7, 8, 5, 6, 7], greedy(24, temperature=1.0, seed=s), make, k, join_at=j)
               for s, k, j in [(11, 4, 0), (12, 3, 1), (13, 6, 2)]]
    others = [Job([1, 2, 3], greedy(20, temperature=0.8, top_p=0.9), make, 4),
              Job([4, 4, 9, 4, 4, 9], greedy(20), make, 8, join_at=1)]
    alone = [job.alone(model) for job in sampled]
    for mix in (sampled + others, others + sampled):
        out, _, violations = run_batched(model, mix, EngineConfig(max_batch=3), check_kv=False)
        assert violations == []
        for i, job in enumerate(mix):
            if job in sampled:
                assert out[str(i)] == alone[sampled.index(job)]
    assert max(drafter.rows_per_forward) > 1
    assert len({tuple(a) for a in alone}) == 3  # the seeds matter


def test_sampling_law_through_the_batched_draft() -> None:
    drafter = Counted(tiny16_draft())
    counts, drafted, accepted = first_tokens(drafter, 40_000)
    assert int(counts.sum()) == N_SAMPLES
    assert max(drafter.rows_per_forward) >= 4  # the premise: draft steps ran for several rows at once
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


def test_sampling_law_when_the_policy_cuts_sampled_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded sampled rows are not pinned: the policy verifies the prefix of each draft that pays,
    judged by the draft's estimates, and those must not depend on the drawn tokens (a token kept
    only when its own q(x) is high would bias the law). The rows here are seeded, for a
    reproducible test, and unpinned by hand; the drafter drafts whole ks, and every fed token costs
    a fiftieth of a pass, so the policy verifies some tokens and cuts others (counted as a premise)."""
    monkeypatch.setattr(engine_rows.Row, "pinned", property(lambda self: False))
    monkeypatch.setattr(draft_cost, "worth", lambda rows, *args, **kw: rows)
    cut = []
    choose = engine_scheduler.choose_draft_lengths

    def steep(rows, cost, *args, **kw):
        for n in range(1, 80):
            cost.observe(n, 1.0 + 0.02 * (n - 1))
        lengths = choose(rows, cost, *args, **kw)
        cut.extend(r.available - n for r, n in zip(rows, lengths))
        return lengths
    monkeypatch.setattr(engine_scheduler, "choose_draft_lengths", steep)
    counts, drafted, accepted = first_tokens(Counted(tiny16_draft()), 50_000)
    assert sum(c > 0 for c in cut) > N_SAMPLES // 4 and drafted > 0
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


def test_sampling_law_negative_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter whose draws do not follow the q it reports (it draws from q^3, renormalized: a
    sharper draft) must fail the same test with the same number of requests."""
    real = draft_chain.sample
    monkeypatch.setattr(draft_chain, "sample", lambda q, generator: real(q ** 3, generator))
    counts, drafted, accepted = first_tokens(Drafter(tiny16_draft()), 40_000)
    assert 0 < accepted < drafted
    law = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0), N_TOKENS)
    assert chi_square_p_value(counts, law) < ALPHA


def test_a_failing_member_ends_only_its_request() -> None:
    """A member whose tokens the draft model cannot run (an id past its vocabulary, from its second
    step on) makes the group's forward fail: that request ends with the error, the others draft
    on (alone, then together again) and emit plain greedy's tokens."""
    model = target()
    drafter = Counted(noisy_draft())
    engine = Engine(model, EngineConfig(max_batch=3))
    make = member(drafter, [])
    good = [Job([1, 17, 42, 8], greedy(15), make, 4), Job([44, 12, 19], greedy(15), make, 3)]
    for i, job in enumerate(good):
        engine.add(job.request(str(i)))
    bad = make([5, 6, 7], greedy(15))
    took, seen = bad.took, []  # what the member is told when its drafter commits its step

    def poisoned(step: Committed) -> None:
        seen.append(step)
        took(Committed(step.tokens[:-1] + [model.config.vocab_size + 5], step.drafted, step.verified,
                         step.features) if len(seen) == 2 else step)
    bad.took = poisoned
    engine.add(Request([5, 6, 7], greedy(15), frozenset(), bad, 4, id="bad"))
    events: dict[str, list] = {}
    while engine.has_work():
        for rid, event in engine.step():
            events.setdefault(rid, []).append(event)
    assert events["bad"][-1].finish_reason == "error"
    assert len([t for e in events["bad"] for t in e.token_ids]) < 15
    for i, job in enumerate(good):
        assert [t for e in events[str(i)] for t in e.token_ids] == Job(job.prompt, job.params, None, 0).alone(model)
        assert events[str(i)][-1].finish_reason == "length"
    rows = drafter.rows_per_forward
    last_three = len(rows) - 1 - rows[::-1].index(3)  # the three drafted together, then two did
    assert 2 in rows[last_three:]


def test_rows_return_to_the_pool() -> None:
    drafter = Drafter(noisy_draft())
    params = greedy(5)
    first = DraftModelProposer(drafter, [1, 2, 3], params, 20)
    second = DraftModelProposer(drafter, [1, 2, 3, 4], params, 20)
    assert drafter.rows.of(first) is None  # a row from the first proposal on
    drafter.propose([first, second], [2, 2])
    assert (draft_state(first).row, draft_state(second).row) == (0, 1) and draft_state(second).cached == 4
    drafter.release([first])  # (drafting outside an engine: its user releases it)
    third = DraftModelProposer(drafter, [4, 5], params, 40)  # longer: the cache grows, rows keep
    third.propose(1)
    assert draft_state(third).row == 0 and drafter.rows.cache.batch_size == 2 and drafter.rows.cache.max_len >= 40
    assert kv_mismatch(second.model, second.cache, [1, 2, 3, 4]) <= KV_TOL
    fourth = DraftModelProposer(drafter, [1, 2, 3], greedy(12), 30)
    ids = [t for e in generate_tokens(target(), [1, 2, 3], greedy(12), frozenset(), fourth, 3) for t in e.token_ids]
    assert ids == [t for e in generate_tokens(target(), [1, 2, 3], greedy(12)) for t in e.token_ids]
    assert drafter.rows.of(fourth) is None and list(drafter.rows.released) == [2]  # its request ended: row 2 goes back


def test_an_ended_request_gives_its_row_back_without_the_collector() -> None:
    """The engine releases a request's draft row when the request ends (ProposerGroup.release):
    the next request reuses it even where the ended proposer is still referenced, in a reference
    cycle, with the garbage collector off; a member kept and never released keeps its row."""
    drafter = Drafter(noisy_draft())
    kept = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for n in range(3):
            member = DraftModelProposer(drafter, [1, 2, 3], greedy(6), 30)
            member.me = member  # a cycle: only the collector could free it
            kept.append(member)
            list(generate_tokens(target(), [1, 2, 3], greedy(6), frozenset(), member, 3))
            assert drafter.rows.of(member) is None and len(drafter.rows.taken) == 1, n
        idle = DraftModelProposer(drafter, [1, 2, 3], greedy(4), 12)
        idle.propose(2)  # drafting outside an engine: nothing releases it while it lives
        member = DraftModelProposer(drafter, [4, 5], greedy(6), 30)
        list(generate_tokens(target(), [4, 5], greedy(6), frozenset(), member, 3))
        assert len(drafter.rows.taken) == 2 and drafter.rows.of(idle) is not None
        drafter.release([idle])
        drafter.rows.reclaim()
        assert drafter.rows.taken == [False, False]
    finally:
        if enabled:
            gc.enable()


def test_a_targets_requests_draft_with_one_drafter(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the API (as the server makes proposers): every request of one target drafting
    with one draft model is a member of the same Drafter, so their draft steps batch."""
    target_dir = tiny_llm_dir(tmp_path / "target")
    draft_dir = tiny_llm_dir(tmp_path / "draft", seed=3)
    llm = quickdraft.load(str(target_dir), spec=SpecConfig("draft", k=4, draft_model=str(draft_dir)))
    rows_per_forward: list[int] = []
    forward = Drafter.forward

    def counted(self, states, feeds, starts):
        rows_per_forward.append(len(states))
        return forward(self, states, feeds, starts)
    monkeypatch.setattr(Drafter, "forward", counted)

    def make(prompt: Sequence[int], params: SamplingParams) -> Proposer:
        return llm.proposer(list(prompt), params, llm.spec)
    first, second = make([1, 2], greedy(4)), make([3, 4], greedy(4))
    assert first.group is second.group and first.group.model is llm.draft_model(str(draft_dir)).model
    batch = [Job([1, 17, 42, 8, 77, 23], greedy(20), make, 4),
             Job([44, 12, 19], greedy(16), make, 3, join_at=1),
             Job([9, 2, 9, 2, 9, 2, 9], greedy(18), make, 4, join_at=2)]
    # the fixed policy: every row drafts its k each step, whatever the draft's measured acceptance
    # (this random draft's is low, and under goodput rows stop drafting as they learn it)
    out, _, violations = run_batched(llm.model, batch, EngineConfig(max_batch=3, policy="fixed"))
    assert violations == [] and max(rows_per_forward) == 3
    for i, job in enumerate(batch):
        assert out[str(i)] == Job(job.prompt, job.params, None, 0).alone(llm.model), f"request {i} differs"


def test_a_closed_engine_releases_its_requests_draft_rows() -> None:
    """A generation left early (its engine closed with requests in it): the draft rows go back when
    the call ends, not when the proposers become garbage (they are kept alive here)."""
    drafter = Drafter(noisy_draft())
    kept = [DraftModelProposer(drafter, [1, 2, 3], greedy(30), 40) for _ in range(2)]
    for member in kept:
        stream = generate_tokens(target(), [1, 2, 3], greedy(30), frozenset(), member, 3)
        next(stream), next(stream)  # it has drafted: it holds a row
        assert drafter.rows.of(member) is not None
        stream.close()
        assert drafter.rows.of(member) is None
    drafter.rows.reclaim()
    assert drafter.rows.taken == [False]  # the second reused the first's row
    engine = Engine(target(), EngineConfig(max_batch=2))
    for i, member in enumerate(DraftModelProposer(drafter, [1, 2, 3], greedy(30), 40) for _ in range(2)):
        engine.add(Request([1, 2, 3], greedy(30), frozenset(), member, 3, id=str(i)))
        kept.append(member)
    for _ in range(4):
        engine.step()
    assert all(drafter.rows.of(m) is not None for m in kept[2:])
    engine.close()
    assert all(drafter.rows.of(m) is None for m in kept) and engine.cache.held.sum() == 0


def test_a_hybrid_releases_the_draft_model_it_drafts_through() -> None:
    """Prompt lookup with a draft model (lookup-draft): the request's end releases the draft model's
    member too (base.Each.release of the hybrid's parts), with the collector off and the hybrid kept."""
    from quickdraft.proposers.hybrid import HybridProposer
    drafter = Drafter(noisy_draft())
    enabled = gc.isenabled()
    gc.disable()
    try:
        inner = DraftModelProposer(drafter, [1, 2, 3], greedy(12), 40)
        hybrid = HybridProposer(NgramProposer([1, 2, 3], 4, 1), inner, "draft")
        hybrid.me = hybrid  # a cycle: only the collector could free it
        list(generate_tokens(target(), [1, 2, 3], greedy(12), frozenset(), hybrid, 3))
        assert drafter.rows.cache is not None, "the premise: the draft model drafted"
        assert drafter.rows.of(inner) is None and list(drafter.rows.released) == [0]
    finally:
        if enabled:
            gc.enable()


class Releases(Each):
    """A group that records the members it is told to release (they draft nothing)."""

    def __init__(self) -> None:
        self.released: list[Proposer] = []

    def release(self, members: Sequence[Proposer]) -> None:
        self.released += members


class Quiet:
    """A proposer that drafts nothing, in a group of its own."""

    def __init__(self, group: Releases) -> None:
        self.group = group

    def commit(self, step: Committed) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return NO_DRAFT


def test_a_failed_prompt_gives_back_its_blocks_and_proposer_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt whose prefill fails (here its first token's verification), riding beside a decoding
    row: its request ends alone, its cache row's blocks go back in that step (not at some later
    admission that lands on its row) and its proposer is released; the decoding row goes on."""
    import quickdraft.engine.admission as admission
    group = Releases()
    engine = Engine(target(), EngineConfig(max_batch=2))
    engine.add(Request([1, 2, 3, 4], greedy(20), frozenset(), id="runs"))
    engine.step()
    failing = Quiet(group)
    engine.add(Request(list(range(5, 30)), greedy(20), frozenset(), failing, 3, id="fails"))

    def broken(*args, **kwargs):
        raise RuntimeError("broken first token")

    monkeypatch.setattr(admission, "verify", broken)
    events = []
    while not any(rid == "fails" for rid, _ in events):
        events += engine.step()
    assert [e.finish_reason for rid, e in events if rid == "fails"] == ["error"]
    assert group.released == [failing] and engine.filling is None
    assert engine.cache.held[1:].sum() == 0 and engine.cache.held[0] > 0  # the runner's alone
    monkeypatch.undo()
    while engine.has_work():
        engine.step()
    engine.step()  # (a row that ended is freed at the next step)
    assert engine.cache.held.sum() == 0


def test_every_end_of_a_request_releases_its_proposer() -> None:
    """A request cancelled while waiting, one only scored (max_new_tokens 0), those waiting when the
    engine closes, and one the engine refuses after the service made its proposer: each proposer's
    group is told to let go of it."""
    from quickdraft.engine.service import EngineService
    group = Releases()
    engine = Engine(target(), EngineConfig(max_batch=1))
    members = [Quiet(group) for _ in range(4)]
    engine.add(Request([1, 2, 3], greedy(5), frozenset(), id="first"))
    engine.add(Request([1, 2, 3], greedy(5), frozenset(), members[0], 3, id="cancelled"))
    assert engine.cancel("cancelled") and group.released == members[:1]
    engine.add(Request([4, 5, 6], SamplingParams(max_new_tokens=0), frozenset(), members[1], 3, id="scored"))
    while engine.has_work():
        engine.step()
    assert group.released == members[:2]
    engine.add(Request([1, 2, 3], greedy(5), frozenset(), members[2], 3, id="left"))
    engine.close()
    assert group.released == members[:3]
    service, told = EngineService(Engine(target(), EngineConfig(max_batch=1, max_seq_len=8))), []
    service.submit(Request(list(range(1, 20)), greedy(5), frozenset(), None, 3, id="long"), told.append,
                   lambda: members[3])
    service.drive(blocking=False)
    assert told[-1].finish_reason == "error" and group.released == members


@pytest.mark.parametrize("fails", ["rider", "none"])
def test_a_prompt_that_fails_riding_ends_the_steps_prefill(monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """A prompt whose chunk rode in the decode pass and then failed (its first token's verification
    here) took the step's prefill: the next waiting prompt is not prefilled in that step as well
    (the step already paid for the failed pass). The control: the rider succeeds, its prompt done,
    and the rest of the step's room goes to the next prompt in a pass of its own."""
    import quickdraft.engine.admission as admission
    engine = Engine(target(), EngineConfig(max_batch=3, prefill_chunk=16))
    engine.add(Request([1, 2, 3, 4], greedy(20), frozenset(), id="runs"))
    engine.step()
    engine.add(Request([5, 6, 7, 8, 9, 10], greedy(5), frozenset(), id="rides"))
    engine.add(Request([11, 12, 13, 14, 15, 16], greedy(5), frozenset(), id="next"))
    real, calls = admission.verify, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if fails == "rider" and len(calls) == 1:
            raise RuntimeError("broken first token")
        return real(*args, **kwargs)

    monkeypatch.setattr(admission, "verify", first_fails)
    events = engine.step()  # "rides" rides in the pass of "runs" (6 of the 16 tokens of room)
    finished = {rid: e.finish_reason for rid, e in events if rid != "runs"}
    if fails == "rider":
        assert finished == {"rides": "error"} and [r.id for r in engine.waiting] == ["next"]
    else:  # both prompts in this step: 6 rode, 6 in a pass of their own
        assert set(finished) == {"rides", "next"} and not engine.waiting and engine.filling is None
