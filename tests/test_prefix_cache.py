"""The prefix cache and chunked prefill change what is computed, never what comes out.

Oracles: each request run alone with no prefix cache (token for token, and the K/V and features
of its prompt bitwise), K/V recomputed from scratch after every step, the exact law of the first
sampled tokens after a cached prefix (chi-square, with a negative control), and the cache's own
bookkeeping (what it holds, evicts and counts) against a budget.
"""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from quickdraft.engine import scheduler
from quickdraft.engine.admission import Admission
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.policy import StepCost
from quickdraft.engine.prefill import MIN_CHUNK, PASSED_OVER, RETIME, STALL, next_admitted, step_allowance
from quickdraft.kv.blocks import BlockPool
from quickdraft.kv.prefix_cache import BLOCK, PrefixCache
from quickdraft.proposers.base import EACH, Committed, Draft
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.engine import Job, draft_random, draft_same, drive, greedy, ngram
from support.laws import ALPHA, N_SAMPLES, SAMPLE_K, chi_square_p_value, plain_law
from support.models import KV_TOL, kv_mismatch, tiny, tiny16
from support.prefix import CONVERSATION, MB, MODEL, prefix_for, random_cache, tokens


def test_an_engine_refuses_a_prefix_cache_whose_blocks_are_not_its_models() -> None:
    """Rows live in the prefix cache's pool: blocks of another dtype (or device) are refused by
    name, not met later as a pass's dtype or device error."""
    model = tiny(MODEL)
    other = PrefixCache(64 * MB, model.config, torch.bfloat16, pool=BlockPool(model.config, torch.bfloat16))
    with pytest.raises(ValueError, match="prefix cache's blocks are torch.bfloat16 on cpu, the model's K/V "
                                         "torch.float32 on cpu"):
        Engine(model, EngineConfig(max_batch=2), prefix=other)


# -- the trie of blocks ----------------------------------------------------------------------------------

def test_scopes_find_only_their_own_blocks_and_evict_from_the_largest() -> None:
    """A client's prompt cached in its scope: another scope's request finds nothing of it (neither
    its cached_tokens nor its time tells it what was sent), and another scope's long prompts evict
    their own blocks before the smaller scope's. Negative control: in one scope the same long
    prompt evicts the first client's blocks (least recently used first)."""
    model = tiny(MODEL)
    cache = random_cache(model, 1, 64, seed=0)
    D = model.config.hidden_size
    secret, long = tokens(1, 32), tokens(2, 64)
    for shared in (False, True):
        prefix = prefix_for(model, budget=5 * prefix_for(model).block_bytes)
        a, b = "", "" if shared else "tenant b"
        prefix.store(secret, cache, 0, torch.randn(32, D), scope=a)
        assert prefix.hit(secret, 32, scope=a) == 32
        assert prefix.hit(secret, 32, scope=b) == (32 if shared else 0)
        prefix.store(long, cache, 0, torch.randn(64, D), scope=b)  # 4 blocks: 3 fit beside the 2 of a
        assert prefix.stats.bytes <= prefix.budget_bytes
        if shared:
            assert prefix.hit(secret, 32, scope=a) == 16 and prefix.hit(long, 64, scope=b) == 64  # LRU: a block of a
        else:
            assert prefix.hit(secret, 32, scope=a) == 32 and prefix.hit(long, 64, scope=b) == 48
            assert prefix.stats.scopes == {a: 2, b: 3} and prefix.stats.evictions == 0
            prefix.store(tokens(3, 32), cache, 0, torch.randn(32, D), scope=b)  # b the larger: evicts its own
            assert prefix.hit(secret, 32, scope=a) == 32 and prefix.stats.scopes == {a: 2, b: 3}
            prefix.store(tokens(4, 64), cache, 0, torch.randn(64, D), scope="tenant c")  # a third scope: from b
            assert prefix.hit(secret, 32, scope=a) == 32 and prefix.stats.scopes["tenant b"] < 3


def test_blocks_are_matched_loaded_and_evicted_least_recent_first() -> None:
    model = tiny(MODEL)
    cache = random_cache(model, 2, 64, seed=0)
    D = model.config.hidden_size
    first, second = tokens(1, 40), tokens(2, 40)
    assert first[16] != second[16]
    prefix = prefix_for(model, budget=3 * prefix_for(model).block_bytes)
    stored = torch.randn(40, D)
    prefix.store(first, cache, 0, stored)
    assert prefix.stats.blocks == 3 and prefix.stats.bytes == 3 * prefix.block_bytes  # 40 tokens: 2 blocks, a tail of 8
    assert prefix.hit(first, 40) == 40 and prefix.hit(first + second, 80) == 40
    assert prefix.hit(first, 31) == 31                       # within the limit only: 15 tokens of the 2nd block
    assert prefix.hit(first[:16] + second[16:], 40) == 16    # up to the first token that differs
    assert prefix.hit(first[:35] + second[35:], 40) == 35    # into the tail as far as it agrees
    assert prefix.hit(second, 40) == 0
    features = prefix.fetch(first[:37] + [1, 2], 39, cache, 1)
    assert torch.equal(features, stored[:37])
    assert torch.equal(cache.read(1, 0, 37), cache.read(0, 0, 37))  # bitwise the stored K/V
    # the budget holds 3 blocks: storing 3 new ones evicts the least recently used leaves, first's tail,
    # then the blocks that became leaves
    prefix.store(second, cache, 0, torch.randn(40, D))
    assert prefix.stats.blocks == 3 and prefix.stats.evictions == 3
    assert prefix.hit(first, 40) == 0 and prefix.hit(second, 40) == 40
    # a path being stored is never evicted to make room for itself: with a budget of 3, only 3 of 4 are kept
    third = tokens(3, 64)
    prefix.store(third, cache, 0, torch.randn(64, D))
    assert prefix.hit(third, 64) == 48 and prefix.stats.bytes <= prefix.budget_bytes


def test_a_chat_turn_finds_every_token_of_the_last_and_tails_give_way() -> None:
    """A conversation's turns: each stored sequence ends in a tail; the next turn's prompt (the last
    one and its answer, then more) finds all of it; storing the longer turn drops the tail it covers."""
    model = tiny(MODEL)
    cache = random_cache(model, 1, 64, seed=1)
    D = model.config.hidden_size
    prefix = prefix_for(model)
    chat = tokens(6, 60)
    prefix.store(chat[:37], cache, 0, torch.randn(37, D))   # 2 blocks and a tail of 5
    assert prefix.stats.blocks == 3
    assert prefix.hit(chat[:47], 46) == 37
    prefix.store(chat[:47], cache, 0, torch.randn(47, D))   # the tail of 15 covers the tail of 5: it goes
    assert prefix.stats.blocks == 3 and prefix.hit(chat, 59) == 47
    prefix.store(chat[:40], cache, 0, torch.randn(40, D))   # held already, inside the longer tail
    assert prefix.stats.blocks == 3
    prefix.store(chat[:33] + [7, 7], cache, 0, torch.randn(35, D))  # another way from token 33: a tail of its own
    assert prefix.stats.blocks == 4 and prefix.hit(chat[:33] + [7, 7, 9], 37) == 35 and prefix.hit(chat, 59) == 47


def test_a_budget_below_one_block_is_refused() -> None:
    model = tiny(MODEL)
    block = prefix_for(model).block_bytes
    with pytest.raises(ValueError, match="below one block"):
        prefix_for(model, budget=block - 1)


# -- a hit is a full prefill ----------------------------------------------------------------------------

class Recorder(NgramProposer):
    """Prompt lookup that keeps what it is told after the prompt's pass."""

    def __init__(self, prompt: Sequence[int]) -> None:
        super().__init__(prompt, 4, 1)
        self.told: list[Committed] = []

    def commit(self, step: Committed) -> None:
        self.told.append(step)
        super().commit(step)


def run_to_end(engine: Engine, request: Request, after_prompt=lambda: None) -> list[int]:
    """The request's tokens; `after_prompt` is called once its prompt's pass is done."""
    engine.add(request)
    out: list[int] = []
    while engine.has_work():
        for _, event in engine.step():
            assert event.error is None, event.error
            if not out:
                after_prompt()
            out += event.token_ids
    return out


@pytest.mark.parametrize("model_name", [MODEL, f"{MODEL}@Q4_1", "qwen2-qkv-bias@Q6_K+int8"])
def test_a_prefix_hit_gives_bitwise_what_a_full_prefill_gives(model_name: str) -> None:
    """A second turn (the first turn's prompt and answer, then more) after the first: its prompt's
    K/V, features, first token's ranking and every token are bitwise those of the same request on
    an engine that never saw the first. Float matrices keep this only because prefill passes stay
    within the C kernel's rows (Transformer.invariant_rows): torch's GEMM, past them, sums in another order."""
    model = tiny(model_name)
    first = tokens(4, 70)
    warm = Engine(model, EngineConfig(max_batch=2), prefix=prefix_for(model))
    second = first + run_to_end(warm, Request(first, greedy(30), id="turn1")) + tokens(5, 9)
    n = len(second)
    kv: dict[str, list[torch.Tensor]] = {}
    told: dict[str, Recorder] = {}
    outs: dict[str, list[int]] = {}
    for name, engine in [("warm", warm), ("cold", Engine(model, EngineConfig(max_batch=2)))]:
        told[name] = Recorder(second)
        keep = lambda e=engine, name=name: kv.setdefault(name, e.cache.read(0, 0, n))
        outs[name] = run_to_end(engine, Request(second, greedy(20), frozenset(), told[name], 4, adaptive=False), keep)
    assert warm.prefix.stats.hit_tokens == n - 9 - 1  # the premise: the first turn was cached (its last token has no K/V)
    assert torch.equal(kv["warm"], kv["cold"])
    warm_told, cold_told = told["warm"].told, told["cold"].told
    assert torch.equal(warm_told[0].features, cold_told[0].features)
    assert warm_told[0].top(4) == cold_told[0].top(4)  # the first token's logits rank alike
    # whole drafts verified (adaptive=False): every step's commit alike, not only the text
    assert [c.tokens for c in warm_told] == [c.tokens for c in cold_told] and outs["warm"] == outs["cold"]
    if "@" not in model_name:
        assert n > model.invariant_rows  # the premise: the kernel's row cap was needed


# -- every output as without the cache, rows joining and leaving ------------------------------------------

PROPOSERS = {None: None, "ngram": ngram, "draft_same": draft_same, "draft_random": draft_random}


def conversation_jobs() -> list[Job]:
    return [Job(prompt, greedy(24), PROPOSERS[make], k, join_at=at) for prompt, make, k, at in CONVERSATION]


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_prefixes_and_chunked_prefill_keep_every_output(batch: int, chunk: int | None) -> None:
    """Sessions sharing a system prompt, joining while others decode and leaving: every request
    emits what it emits alone on an engine with neither a prefix cache nor chunks, and after every
    step each row's K/V are what a fresh forward over its tokens computes."""
    model = tiny(MODEL, init=0.1)
    jobs = conversation_jobs()

    def fresh_kv(engine, events):  # each running row's K/V what a fresh forward over its tokens computes
        for index, row in enumerate(engine.rows):
            if row not in engine.finished:
                assert kv_mismatch(model, engine.cache.rows(index, index + 1), row.tokens[:row.length]) <= KV_TOL
    out, cached = drive(Engine(model, EngineConfig(max_batch=batch, prefill_chunk=chunk), prefix=prefix_for(model)),
                        jobs, fresh_kv)
    for i, job in enumerate(jobs):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    assert cached["5"] == 0 and all(cached[str(i)] >= 32 for i in (3, 4, 6))  # the premise: hits happened


def test_sampling_law_through_a_cached_prefix() -> None:
    """N_SAMPLES seeded requests whose prompt comes from the cache but for its last token (all but
    the first): their first tokens follow plain sampling's exact law after that prompt (chi-square at
    ALPHA), and the law at another temperature (negative control) is rejected."""
    model = tiny16()
    prompt = [3, 7, 11, 3, 7, 11, 3, 7, 5, 9, 3, 7, 11, 3, 7, 11, 3, 7, 5]  # 19 tokens: a block and a tail
    engine = Engine(model, EngineConfig(max_batch=8), prefix=prefix_for(model))
    n_tokens, V = 3, model.config.vocab_size
    counts = torch.zeros([V] * n_tokens, dtype=torch.long)
    ids: dict[str, list[int]] = {}
    hits = drafted = accepted = 0
    for seed in range(40_000, 40_000 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=4, ignore_eos=True)
        engine.add(Request(prompt, p, frozenset(), NgramProposer(prompt, 4, 1), SAMPLE_K, id=str(seed)))
    while engine.has_work():
        for rid, event in engine.step():
            ids.setdefault(rid, []).extend(event.token_ids)
            if event.finish_reason:
                hits += event.stats.cached_tokens == len(prompt) - 1
                drafted += event.stats.drafted_tokens
                accepted += event.stats.accepted_tokens
                counts[tuple(ids[rid][:n_tokens])] += 1
    assert hits >= N_SAMPLES - 8 and 0 < accepted < drafted  # the premises: cached, drafts both ways
    law = plain_law(model, prompt, SamplingParams(temperature=1.0), n_tokens)
    assert (counts[law == 0] == 0).all()
    assert chi_square_p_value(counts, law) > ALPHA
    other = plain_law(model, prompt, SamplingParams(temperature=0.75), n_tokens)
    assert chi_square_p_value(counts, other) < ALPHA


# -- chunked prefill --------------------------------------------------------------------------------------

def test_the_step_allowance_follows_the_last_prefill_pass() -> None:
    step = StepCost()
    assert step_allowance(0, step, None, None) is None          # nothing decodes: whole prompts
    assert step_allowance(2, step, (32, 0.04), 7) == 7           # asked for
    step.observe(1, 0.010)
    assert step_allowance(1, step, None, None) == MIN_CHUNK      # nothing measured yet
    assert step_allowance(1, step, (32, 0.040), None) == int(STALL * 0.010 / 0.00125)  # STALL decode steps' worth
    assert step_allowance(1, step, (32, 10.0), None) == MIN_CHUNK  # slower than any budget: prompts still advance
    assert step_allowance(1, step, (16, 0.001), None) == 32      # cheap: at most GROWTH times the last size
    # a whole 1,900-token prompt's pass (attention over all of it) still gives a sensible first chunk
    assert step_allowance(1, step, (1900, 3.0), None) == int(1900 * STALL * 0.010 / 3.0)
    assert step_allowance(1, step, (32, 0.040), None, untimed=RETIME) == 0  # the rows are timed alone
    assert step_allowance(1, step, (32, 0.040), 7, untimed=RETIME) == 7     # a size asked for is kept


def test_the_shortest_remaining_prompt_is_admitted_first_and_none_waits_forever() -> None:
    assert next_admitted([300, 20, 40], [0, 0, 0]) == 1
    assert next_admitted([30, 20, 20], [0, 0, 0]) == 1                      # equals: arrival order
    assert next_admitted([300, 20, 40], [PASSED_OVER, 0, PASSED_OVER]) == 0  # overdue: the oldest first


def test_sessions_behind_a_shared_prefix_are_admitted_by_what_they_have_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts wait while a stream decodes: the one whose long prefix is cached goes first,
    then the short one, then the long uncached one; every output is the request's alone."""
    model = tiny(MODEL)
    prefix = prefix_for(model)
    system = tokens(50, 96)
    engine = Engine(model, EngineConfig(max_batch=4), prefix=prefix)
    run_to_end(engine, Request(system + tokens(51, 5), greedy(2)))      # leaves the system prompt cached
    jobs = {"long": Job(tokens(52, 90), greedy(6), None, 0), "short": Job(tokens(53, 30), greedy(6), None, 0),
            "shared": Job(system + tokens(54, 8), greedy(6), None, 0)}
    admitted: list[str] = []
    admit = Admission._admit
    monkeypatch.setattr(Admission, "_admit", lambda self, request: admitted.append(request.id) or admit(self, request))
    engine.add(Job(tokens(55, 6), greedy(60), None, 0).request("stream"))
    engine.step()
    for name, job in jobs.items():
        engine.add(job.request(name))
    out = {name: [] for name in jobs}
    while engine.has_work():
        for rid, event in engine.step():
            out.setdefault(rid, []).extend(event.token_ids)
    assert admitted[1:] == ["shared", "short", "long"]
    assert all(out[name] == job.alone(model) for name, job in jobs.items())


def test_a_long_prompt_does_not_stall_a_running_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a 200-token prompt is prefilled, a running stream still gets a token every step, and
    the prompt's passes in each such step feed no more than the step's allowance; both outputs
    are exact."""
    allowed: list[int | None] = []

    def recorded(*args) -> int | None:
        allowed.append(step_allowance(*args))
        return allowed[-1]

    monkeypatch.setattr(scheduler, "step_allowance", recorded)
    model = tiny(MODEL, init=0.1)
    engine = Engine(model, EngineConfig(max_batch=2))
    stream, long = Job([1, 17, 42, 8], greedy(40), None, 0), Job(tokens(11, 200), greedy(5), None, 0)
    out: dict[str, list[int]] = {"s": [], "l": []}
    engine.add(stream.request("s"))
    out["s"] += engine.step()[0][1].token_ids
    engine.add(long.request("l"))
    fed = []  # per step while the prompt is prefilled: (tokens fed, allowance, the stream's tokens)
    while engine.has_work():
        before, allowed[:] = (engine.filling.length if engine.filling else 0), []
        events = dict(engine.step())
        if engine.filling or "l" in events and not out["l"]:
            fed.append(((engine.filling.length if engine.filling else 200) - before, list(allowed),
                        len(events["s"].token_ids)))
        for rid, event in events.items():
            out[rid] += event.token_ids
    assert len(fed) > 3  # the premise: the prompt took several steps
    assert all(len(a) == 1 and n <= a[0] and got == 1 for n, a, got in fed), fed
    assert out["s"] == stream.alone(model) and out["l"] == long.alone(model)


def test_rows_decoding_beside_a_filling_prompt_are_timed_alone_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's cost is what it adds to the decoding rows' estimated step, measured only in steps
    without a chunk: while a long prompt fills, every RETIME steps one step times the rows alone,
    and its time replaces the estimate (which said what they cost at a shorter context)."""
    model = tiny(MODEL, init=0.1)
    engine = Engine(model, EngineConfig(max_batch=2))
    stream, long = Job([1, 17, 42, 8], greedy(200), None, 0), Job(tokens(12, 200), greedy(2), None, 0)
    engine.add(stream.request("s"))
    engine.step()
    engine.step()  # (the engine's first decode pass, which is not timed)
    engine.cost.retime(1, 1e-6)  # stale: a decode step far cheaper than it is, so chunks look dear
    retimed: list[tuple[int, float]] = []
    real = engine.cost.retime
    monkeypatch.setattr(engine.cost, "retime", lambda n, s: (retimed.append((n, s)), real(n, s)))
    engine.add(long.request("l"))
    fed = []  # prompt tokens each step fed while the prompt filled
    while engine.filling is not None or engine.waiting:
        before = engine.filling.length if engine.filling else 0
        engine.step()
        fed.append((engine.filling.length if engine.filling else 200) - before)
    first = fed.index(0)  # the first step that timed the rows alone
    assert 0 < first <= RETIME + 1 and all(n > 0 for n in fed[first + 1:first + RETIME]), fed
    assert max(fed[:first]) <= 2 < max(fed[first + 1:])  # starved by the stale estimate, then not
    assert retimed and retimed[0][0] == 1 and engine.cost.step_s[1] > 1e-4  # the stale estimate replaced


def test_memory_stays_within_the_budget_under_many_prompts() -> None:
    model = tiny(MODEL)
    prefix = prefix_for(model, budget=10 * prefix_for(model).block_bytes)
    engine = Engine(model, EngineConfig(max_batch=3), prefix=prefix)
    for i in range(30):
        engine.add(Request(tokens(100 + i, 40 + i), greedy(8), id=str(i)))
    while engine.has_work():
        engine.step()
        assert prefix.stats.bytes <= prefix.budget_bytes
        assert prefix.stats.blocks == len([n for n in prefix._nodes()])
    assert prefix.stats.evictions > 0 and prefix.stats.hit_tokens < 30  # distinct prompts: a token's match by chance


# -- the Python API -----------------------------------------------------------------------------------------

def test_a_notebook_chat_reuses_its_earlier_turns(tmp_path) -> None:
    """LLM.generate shares the model's prefix cache across calls: a second turn resending the first
    reports cached tokens (stats and to_dict) and gives what a model without the cache gives."""
    import quickdraft
    from tiny_tokenizer import tiny_llm_dir

    path = tiny_llm_dir(tmp_path / "m", max_position_embeddings=2048)
    warm, cold = quickdraft.load(str(path)), quickdraft.load(str(path), prefix_cache_mb=0)
    assert cold.prefix is None and warm.prefix.budget_bytes > 0
    history = [{"role": "user", "content": "Tell me about the sea and the ships on it, please. " * 4}]
    first = warm.generate(messages=history, params=greedy(20))
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the harbours?"}]
    second = warm.generate(messages=history, params=greedy(20))
    assert second.stats.cached_tokens > 0 and second.stats.to_dict()["cached_tokens"] == second.stats.cached_tokens
    assert second.token_ids == cold.generate(messages=history, params=greedy(20)).token_ids


def test_a_consumer_that_stops_early_leaves_its_tokens_to_the_cache() -> None:
    """A caller that stops iterating (a stop string found, a client gone) closes generate_tokens:
    the tokens committed so far are kept, not only the prompt's."""
    from quickdraft.engine.loop import generate_tokens

    model = tiny(MODEL, init=0.1)
    prefix, prompt = prefix_for(model), tokens(12, 20)
    events, got = generate_tokens(model, prompt, greedy(60), prefix=prefix), []
    for event in events:
        got += event.token_ids
        if len(got) >= 30:
            break
    events.close()
    assert prefix.hit(prompt + got, len(prompt) + len(got)) == len(prompt) + len(got) - 1  # the last has no K/V yet


# -- failures of the cache, wide passes, odd cost curves ---------------------------------------------------

def test_a_failing_prefix_cache_loses_only_the_caching(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that raises (out of memory, say) when asked for a prefix or given one: every request
    still ends with its exact output, and the engine goes on."""
    model = tiny(MODEL, init=0.1)
    jobs = conversation_jobs()[:3]
    prefix = prefix_for(model)

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("no memory for blocks")

    monkeypatch.setattr(prefix, "store", broken)
    monkeypatch.setattr(prefix, "fetch", broken)
    engine = Engine(model, EngineConfig(max_batch=2), prefix=prefix)
    for i, job in enumerate(jobs):
        engine.add(job.request(str(i)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    while engine.has_work():
        for rid, event in engine.step():
            assert event.error is None
            out[rid] += event.token_ids
    assert [out[str(i)] for i in range(len(jobs))] == [job.alone(model) for job in jobs]


def test_a_store_from_the_thread_inside_the_cache_does_not_wait_for_itself() -> None:
    """A stream the garbage collector closes while its thread is inside the cache offers its tokens
    from there: they are dropped, not waited for (the lock is not re-entrant)."""
    import threading

    model = tiny(MODEL)
    cache, prefix = random_cache(model, 1, 64, seed=1), prefix_for(model)
    D = model.config.hidden_size

    def nested() -> None:
        with prefix._locked():
            prefix.store(tokens(13, 32), cache, 0, torch.zeros(32, D))

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and prefix.stats.blocks == 0
    prefix.store(tokens(13, 32), cache, 0, torch.zeros(32, D))  # from outside: kept
    assert prefix.stats.blocks == 2


def test_no_pass_is_wider_than_the_kernel_keeps_batch_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float model's passes stay within its invariant rows, padding included: a row that verifies
    whole drafts of 24 beside others would make 3 x 25 rows, which torch's GEMM (past the C
    kernel's 64) sums in another order than each row alone; the engine splits the pass instead."""
    model = tiny(MODEL, init=0.1)
    widths: list[int] = []
    forward = type(model).forward

    def recorded(self, tokens, *args, **kwargs):
        widths.append(tokens.shape[0] * tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recorded)
    class Stubborn:  # offers k tokens every step, whatever was accepted
        group = EACH

        def propose(self, k: int) -> Draft:
            return Draft([7] * k, None)

        def commit(self, step: Committed) -> None:
            pass

    jobs = [Job([5, 6, 7, 8, 9, 10], greedy(30), lambda prompt, params: Stubborn(), 24),
            Job([3, 3, 4, 5, 3, 3, 4], greedy(30), ngram, 8), Job([1, 17, 42, 8], greedy(30), None, 0)]
    engine = Engine(model, EngineConfig(max_batch=3, policy="fixed"), prefix=prefix_for(model))
    for i, job in enumerate(jobs):
        engine.add(job.request(str(i)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    while engine.has_work():
        for rid, event in engine.step():
            out[rid] += event.token_ids
    monkeypatch.undo()
    # the premise: rows padded to 25 (24-token drafts) ran in passes of one or two rows, split off the three
    assert max(widths) <= model.invariant_rows and {25, 50} & set(widths)
    assert [out[str(i)] for i in range(len(jobs))] == [job.alone(model) for job in jobs]


def test_a_prompt_is_in_the_cache_from_the_step_it_starts_decoding() -> None:
    """A prompt's K/V go into the prefix cache whole as it starts decoding (its full blocks by
    reference: no step pays for copying them), the row's new tokens when it ends; the tokens are
    those of a run without a prefix cache."""
    model = tiny(MODEL)
    prompt = tokens(8, 7 * BLOCK + 5)
    engine = Engine(model, EngineConfig(max_batch=2), prefix=prefix_for(model))
    engine.add(Request(prompt, greedy(20), id="long"))
    held, out = [], []
    while engine.has_work():
        out += [t for _, e in engine.step() for t in e.token_ids]
        held.append(engine.prefix.stats.blocks)
    assert held[0] == 8 and held[-1] == 8 + 1  # 7 blocks and the prompt's tail; at the end 8 blocks and a tail
    cold = Engine(model, EngineConfig(max_batch=2))
    assert out == run_to_end(cold, Request(prompt, greedy(20), id="cold"))


def test_a_prompt_admitted_behind_one_being_prefilled_finds_all_of_it() -> None:
    """Choices of one request (or sessions behind one system prompt) arrive together: the second is
    admitted while the first's prompt is being prefilled in chunks, and finds it whole once it is in."""
    model = tiny(MODEL)
    prompt = tokens(9, 7 * BLOCK + 3)
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=8), prefix=prefix_for(model))
    engine.add(Request(prompt, greedy(4), id="first"))
    engine.add(Request(prompt, greedy(4), id="second"))
    cached, out = {}, {"first": [], "second": []}
    while engine.has_work():
        for rid, event in engine.step():
            out[rid] += event.token_ids
            cached[rid] = event.stats.cached_tokens
    assert cached == {"first": 0, "second": len(prompt) - 1} and out["first"] == out["second"]


def test_a_row_that_ends_leaves_its_kv_as_it_ends() -> None:
    """A request that ends at its first token after a long prompt (a classifier's, the stall
    benchmark's) leaves its K/V to the cache in the step it ends; a prompt admitted next finds all
    of them, and once no row holds them only the cache's blocks are used."""
    model = tiny(MODEL)
    prompt = tokens(10, 9 * BLOCK + 5)  # 9 blocks and a tail
    engine = Engine(model, EngineConfig(max_batch=2), prefix=prefix_for(model))
    engine.add(Request(prompt, greedy(1), id="short"))
    first = engine.step()
    assert not engine.has_work() and engine.prefix.stats.blocks == 10
    out = run_to_end(engine, Request(prompt, greedy(5), id="same"))
    assert engine.prefix.stats.hit_tokens == len(prompt) - 1
    cold = Engine(model, EngineConfig(max_batch=2))
    assert out == run_to_end(cold, Request(prompt, greedy(5), id="cold"))
    assert [t for _, e in first for t in e.token_ids] == out[:1]
    engine.step()  # the ended row is freed
    assert engine.cache.pool.used == engine.prefix.stats.blocks
