"""Attacks on ragged passes (a prompt's chunk riding along with the decode rows' pass) and on the
prefix cache's tails: shapes and faults the first tests of each did not try.

Oracles: the padded step's own mask (what each token may see), each request run alone (token for
token, with every row's K/V checked after each step), and the prefix cache's bookkeeping.
"""
from __future__ import annotations

import pytest
import torch

import quickdraft.engine.batch as batch_module
from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.inputs import build_inputs, ragged
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, NO_DRAFT, Draft
from support.engine import OUT_OF_VOCAB, Job, drive, greedy, run_batched, target
from support.models import tiny

LONG = [(i * 7 + 3) % 90 + 1 for i in range(45)]


def test_a_ragged_step_takes_a_tree_beside_a_longer_row() -> None:
    """A row drafting a tree beside a longer row with a shorter draft: the padded step's mask is
    wider (the longest row plus the widest draft) than the slots the ragged pass feeds; each fed
    token must see, in its own row, exactly what the padded step lets it see."""
    cpu = torch.device("cpu")
    lengths, drafts = [30, 10], [NO_DRAFT, Draft([5, 6, 7], parents=[-1, -1, 0])]
    step = build_inputs(lengths, [1, 2], drafts, cpu)
    sizes = [1 + len(d.tokens) for d in drafts]
    for chunk in (None, (3, [8, 9]), (25, [8] * 12)):
        flat = ragged(step, sizes, chunk)
        kv_len = flat.mask.shape[-1]
        t = 0
        for b, size in enumerate(sizes):
            for j in range(size):
                seen = step.mask[b, j]
                assert not seen[kv_len:].any()  # the premise: nothing past the fed slots is seen
                assert torch.equal(flat.mask[0, t, :min(kv_len, seen.shape[0])], seen[:kv_len]), (chunk, b, j)
                t += 1
        if chunk is not None:  # the chunk: causal in its own row
            start, ids = chunk
            for i in range(len(ids)):
                assert torch.equal(flat.mask[0, t + i], torch.arange(kv_len) <= start + i)


class FixedTree:
    """Drafts the same small tree every step (two children of the root, a grandchild under the
    first): whatever it hits, a tree is verified, its slots not its positions."""
    group = EACH

    def __init__(self, prompt, params) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return Draft([3, 9, 4][:k], None, None, [-1, -1, 0][:k])

    def commit(self, step) -> None:
        pass


# windows of 6-12 tokens (Mistral, Gemma 2 with soft caps, Phi-3, Qwen3's windowed layer, Gemma 3's
# local/global layers), whose masks a ragged pass builds per query's row; blocks as stored (any width)
FAMILIES = ["llama-gqa-untied", "mistral-window", "gemma2-softcap", "phi3-fused-window", "qwen3-window-layer",
            "gemma3-sandwich", "llama-gqa-untied@Q8_0"]


@pytest.mark.parametrize("name", FAMILIES)
def test_tree_rows_share_their_pass_with_longer_rows(name, monkeypatch) -> None:
    """A long prompt decodes plainly beside a short one drafting a tree every step (verified whole:
    the fixed policy), and a third prompt's chunks ride along: every output equals its run alone,
    and no step's ragged inputs fail to build (a failure is caught and the rows halved, so outputs
    alone cannot show it: it costs a pass a row)."""
    model = target() if name == "llama-gqa-untied" else tiny(name, init=0.1)
    assert model.ragged
    failed = []

    def watched(*args, **kw):
        try:
            return ragged(*args, **kw)
        except Exception as e:
            failed.append(e)
            raise
    monkeypatch.setattr(batch_module, "ragged", watched)
    jobs = [Job(LONG, greedy(25), None, 0),
            Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(25), FixedTree, 3),
            Job(LONG[3:40], greedy(10), FixedTree, 3, join_at=2)]
    out, _, violations = run_batched(model, jobs, EngineConfig(max_batch=3, prefill_chunk=5, policy="fixed"))
    assert violations == []
    for i, job in enumerate(jobs):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    assert failed == [], f"ragged inputs failed to build: {failed[0]!r}"


def test_a_riding_chunk_that_fails_ends_only_its_own_request() -> None:
    """One row decodes; a prompt the target cannot embed rides along with its pass. The pass
    raises because of the chunk, not the decode row: that row must go on exactly as alone, and
    only the bad prompt's request ends with an error."""
    model = target()
    assert model.ragged
    jobs = [Job([1, 17, 42, 8, 77, 23], greedy(20), None, 0),
            Job([4, OUT_OF_VOCAB, 4], greedy(10), None, 0, join_at=2)]
    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=2))
    assert violations == []
    assert last["0"].finish_reason == "length" and out["0"] == jobs[0].alone(model), "the decode row was blamed"
    assert last["1"].finish_reason == "error" and out["1"] == []


# -- the prefix cache's tails under threads and a small budget ---------------------------------------------

def _fingerprint(prefix: list[int]) -> float:
    """A value that names a token prefix, exact in float32 (below 2^24): what a slot's K/V stand for."""
    h = 0
    for t in prefix:
        h = (h * 131 + t + 1) % 16_777_213
    return float(h)


def _written(model: Transformer, seq: list[int]):
    """A one-row cache whose slot s holds K/V (every layer, head and lane) and features naming seq[:s+1]."""
    cache = model.new_cache(1, len(seq) + 1)
    marks = torch.tensor([_fingerprint(seq[:s + 1]) for s in range(len(seq))])
    c = model.config
    cache.write_rows(0, 0, marks[:, None].expand(-1, c.head_dim).expand(c.num_layers, 2, c.num_kv_heads, -1, -1))
    return cache, marks[:, None].expand(-1, model.config.hidden_size).clone()


def test_tails_under_threads_stay_exact_and_within_the_budget() -> None:
    """Four threads store and fetch sequences of 1-70 tokens sharing a conversation's prefixes (every
    length modulo 16, tails and blocks that go other ways) in one cache of 7 blocks, while a fifth
    folds it: whatever a fetch copies names exactly the fetched prefix (K/V and features), the budget
    holds, and the trie's bookkeeping agrees with its nodes (tails are leaves of fewer than 16)."""
    import random
    import threading

    from quickdraft.kv.prefix_cache import BLOCK, PrefixCache

    model = tiny("llama-gqa-untied")
    base = [(i * 11 + 5) % 40 + 3 for i in range(70)]
    prefix = PrefixCache(7 * PrefixCache.block_size(model.config, model.compute_dtype), model.config,
                         model.compute_dtype)
    errors: list[str] = []
    partial: list[int] = []  # fetches that ended inside a block or in a tail
    done = threading.Event()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            n = rng.randint(1, 70)
            cut = rng.randint(0, n)
            seq = base[:cut] + [rng.randint(3, 6) for _ in range(n - cut)]
            cache, features = _written(model, seq)
            if rng.random() < 0.5:
                prefix.store(seq, cache, 0, features)
                continue
            probe = model.new_cache(1, len(seq) + 1)
            got = prefix.fetch(seq, n - 1 if n > 1 else 0, probe, 0)
            if got is None:
                continue
            m = got.shape[0]
            if m % BLOCK:
                partial.append(m)
            if m > max(n - 1, 0):
                errors.append(f"fetched {m} tokens of a limit of {n - 1}")
            if not torch.equal(got, features[:m]):
                errors.append(f"features of {m} fetched tokens name another prefix")
            if not torch.equal(probe.read(0, 0, m), cache.read(0, 0, m)):
                errors.append(f"K/V of {m} fetched tokens name another prefix")
            if prefix.stats.bytes > prefix.budget_bytes:
                errors.append("over budget")

    def fold() -> None:
        while not done.is_set():
            prefix.fold(lambda above, key: above + len(key), 0)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    folder = threading.Thread(target=fold)
    folder.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    folder.join()
    assert errors == [] and len(partial) > 10  # the premise: fetches ended in tails or inside blocks
    nodes = prefix._nodes()
    assert prefix.stats.blocks == len(nodes) and prefix.stats.bytes == len(nodes) * prefix.block_bytes
    assert prefix.stats.bytes <= prefix.budget_bytes and prefix.stats.evictions > 0
    assert all(len(node.key) == node.features.shape[0] for node in nodes)
    assert prefix.pool.used == len({node.block for node in nodes}) == len(nodes)  # a block each, none leaked
    assert all(not node.children for node in nodes if len(node.key) < BLOCK)  # a tail is a leaf
    depths = prefix.fold(lambda above, key: above + len(key), 0)
    assert sorted(depths) == sorted(_depth(node) for node in nodes)


def _depth(node) -> int:
    n = 0
    while node.parent is not None:
        n, node = n + len(node.key), node.parent
    return n


def test_prompts_cut_at_blocks_and_tails_prefill_from_the_cache_bitwise() -> None:
    """A finished request's tokens in the prefix cache (3 blocks and a tail); then prompts of 16
    and 32 of its tokens (a match ends inside a block), of 1 token, and its whole text plus more
    (a match into its tail) are prefilled, riding along with a long row's decode passes: each
    prompt's K/V equal bitwise those of the same schedule without a prefix cache, and every output
    equals its request's run alone."""
    from quickdraft.engine.batch import Engine
    from quickdraft.kv.prefix_cache import BLOCK, PrefixCache

    model = target()
    assert model.ragged  # chunks ride along
    seed = LONG[2:42]
    answer = Job(seed, greedy(24), None, 0).alone(model)
    jobs = [Job(seed, greedy(24), None, 0), Job(LONG, greedy(70), None, 0),
            Job(seed[:16], greedy(6), None, 0, join_at=30), Job(seed[:32], greedy(6), None, 0, join_at=30),
            Job(seed[:1], greedy(6), None, 0, join_at=31), Job(seed + answer[:12], greedy(6), None, 0, join_at=31)]

    def run(prefix):
        kv = {}

        def keep_kv(engine, events):
            for rid, _ in events:
                if rid not in kv:  # its prompt is in: its K/V as they are now
                    index = next(i for i, r in enumerate(engine.rows) if r.request.id == rid)
                    n = len(jobs[int(rid)].prompt)
                    kv[rid] = engine.cache.read(index, 0, n)
        out, cached = drive(Engine(model, EngineConfig(max_batch=3), prefix=prefix), jobs, keep_kv, limit=300)
        return out, kv, cached

    prefix = PrefixCache(1 << 26, model.config, model.compute_dtype)
    warm, warm_kv, cached = run(prefix)
    cold, cold_kv, _ = run(None)
    assert cached["3"] == 31 and cached["5"] == len(seed) + 11 > 3 * BLOCK  # the premise: into the tail
    for rid in warm:
        assert warm[rid] == cold[rid] == jobs[int(rid)].alone(model), f"request {rid} differs"
        assert all(torch.equal(a, b) for a, b in zip(warm_kv[rid], cold_kv[rid])), f"request {rid}: K/V differ"


def test_a_full_pass_of_pinned_trees_leaves_the_chunk_only_the_rest_of_the_invariant_rows(monkeypatch) -> None:
    """15 seeded rows verify a 3-node tree each (pinned: whole drafts), 60 tokens of the float
    kernel's 64, while a long prompt's chunks ride along: no pass feeds more than 64 tokens, some
    feed exactly 64 (a chunk of the 4 left), and every request equals its run alone."""
    model = target()
    assert model.ragged and model.invariant_rows == 64
    fed = []
    forward = model.forward

    def counted(tokens, positions, cache, *args, rows=None, **kw):
        if rows is not None:
            fed.append(tokens.shape[1])
        return forward(tokens, positions, cache, *args, rows=rows, **kw)
    monkeypatch.setattr(model, "forward", counted)
    jobs = [Job([1 + i, 17, 42, 8 + i], greedy(12, temperature=1.0, seed=i), FixedTree, 3) for i in range(15)]
    jobs.append(Job(LONG, greedy(5), None, 0, join_at=2))
    out, _, violations = run_batched(model, jobs, EngineConfig(max_batch=16), check_kv=False)
    assert violations == []
    for i, job in enumerate(jobs):
        assert out[str(i)] == job.alone(model), f"request {i} differs from its run alone"
    assert max(fed) == 64


def test_rows_cancelled_or_ending_while_a_prompt_rides_in_chunks() -> None:
    """A long prompt rides in chunks of 5 while the rows beside it end (a budget of 3) or are
    cancelled (its cache row moves down under it), then it is cancelled itself mid-prompt and the
    next prompt rides in its place: the rows that go on equal their runs alone, K/V checked."""
    model = target()
    assert model.ragged
    jobs = [Job([1, 17, 42, 8, 77, 23], greedy(40), None, 0),
            Job([9, 2, 9, 2, 9, 2, 9], greedy(30), None, 0),
            Job([3, 3, 4, 5, 3, 3, 4], greedy(3), None, 0, join_at=1),  # ends while the prompt rides
            Job(LONG, greedy(10), None, 0, join_at=2),
            Job(LONG[::-1], greedy(10), None, 0, join_at=2)]
    lengths = {}

    def act(engine, step: int) -> None:
        filling = engine.filling
        if filling is not None:
            lengths.setdefault(filling.request.id, []).append(filling.length)
        if step == 9:
            assert filling is not None and filling.request.id == "3" and 0 < filling.length < len(LONG)
            assert engine.cancel("1")  # its cache row is freed: the prompt's row moves down
        if step == 11:
            assert engine.filling is filling and engine.cancel("3")

    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=4, prefill_chunk=5), on_step=act)
    assert violations == []
    for i in (0, 2, 4):
        assert out[str(i)] == jobs[i].alone(model), f"request {i} differs from its run alone"
    # the premise: "2" ended while "3" was in its prompt, which rode in several chunks, then went
    assert len(lengths["3"]) >= 5 and out["3"] == [] and last["2"].finish_reason == "length"
