"""A draft model's prefix cache: its drafter keeps the draft's K/V of earlier requests' tokens, so
a resent chat history is caught up on only where it is new; what is drafted, and every output,
stays what a fresh catch-up gives.

Oracles: a fresh drafter without the cache (drafts, and the K/V of its row bitwise), plain greedy
decoding (every turn of a conversation, token for token), the catch-up rule's arithmetic with set
timings, and the tokens the catch-ups ran as premises.
"""
from __future__ import annotations

import pytest
import torch

import quickdraft
from quickdraft import kernels
from quickdraft.engine.loop import generate_tokens
from quickdraft.kv.prefix_cache import BLOCK, PrefixCache
from quickdraft.proposers.base import PassCost, SpecConfig
from quickdraft.proposers.draft_cost import ForwardTimes
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams
from support.engine import draft_state, greedy, target
from support.models import tiny
from support.prefix import random_cache, tokens
from tiny_tokenizer import tiny_llm_dir

MB = 1 << 20
K = 4


def kv_cache(model, budget: int) -> PrefixCache:
    return PrefixCache(budget, model.config, model.compute_dtype, feature_width=0)


def member(drafter: Drafter, prompt: list[int], new: int = 24) -> DraftModelProposer:
    return DraftModelProposer(drafter, prompt, greedy(new), len(prompt) + new + K + 1)


def row_kv(drafter: Drafter, m: DraftModelProposer, n: int) -> torch.Tensor:
    """The first n slots of m's row, every layer's K and V: [L, 2, Hkv, n, hd]."""
    return drafter.rows.row_cache(m).read(0, 0, n)


def test_a_cache_of_kv_only_keeps_and_gives_back_blocks_and_tails() -> None:
    model = tiny("llama-gqa-untied")
    c = model.config
    prefix = PrefixCache(MB, c, model.compute_dtype, feature_width=0)
    assert prefix.block_bytes == BLOCK * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # no features
    source, into = random_cache(model, 1, 64, seed=0), model.new_cache(1, 64)
    seq = tokens(1, 40)
    prefix.store(seq, source, 0)  # 40 tokens: 2 blocks and a tail of 8
    assert prefix.stats.blocks == 3 and prefix.hit(seq + [5], 41) == 40 and prefix.hit(seq, 20) == 20
    assert prefix.fetch_kv(seq[:35] + [7], 36, into, 0) == 35
    assert torch.equal(into.read(0, 0, 35), source.read(0, 0, 35))
    assert not into.read(0, 35, 64).any()  # nothing past the hit
    with pytest.raises(AssertionError):
        prefix.store(seq, source, 0, torch.zeros(40, c.hidden_size))


@pytest.mark.parametrize("name", ["llama-gqa-untied@Q4_1", "llama-gqa-untied"])
def test_a_prefix_from_the_cache_is_bitwise_a_fresh_catch_up(name: str) -> None:
    """Turn 1 decodes with a draft member; its request ends, and its row is reused by a request with
    another prompt. Turn 2 (turn 1's prompt, its answer and a new
    message) catches up only past the cached prefix, and its draft and row K/V are bitwise those
    of a drafter without the cache. Float weights too: the catch-up runs in forwards of at most the
    C kernel's rows, where every row's result is independent of the others'."""
    draft = tiny(name)
    drafter, fresh = Drafter(draft, prefix=kv_cache(draft, 64 * MB)), Drafter(draft)
    first = tokens(10, 150)
    a = member(drafter, first, new=30)
    answer = [t for e in generate_tokens(target(), first, greedy(30), frozenset(), a, K, adaptive=False)
              for t in e.token_ids]
    row, held = 0, drafter.prefix.stats.blocks
    assert held == -(-(len(first) - 1) // BLOCK)  # the prompt, offered once caught up: its blocks and a tail
    # its request ended: the engine released the row, whose K/V are stored when it is reused
    assert drafter.rows.of(a) is None and list(drafter.rows.released) == [row] and drafter.prefix.stats.blocks == held
    other = member(drafter, tokens(11, 20))
    other.propose(K)  # reuses the row: the gone member's K/V were stored first
    assert draft_state(other).row == row and drafter.prefix.stats.blocks > held

    second = first + answer + tokens(12, 20)
    before = drafter.caught_up
    b, c = member(drafter, second), member(fresh, second)
    drafted, expected = b.propose(K), c.propose(K)
    assert drafted.tokens == expected.tokens and draft_state(b).confidences == draft_state(c).confidences  # the draft's probabilities, exactly
    assert torch.equal(row_kv(drafter, b, len(second)), row_kv(fresh, c, len(second)))
    # the premises: turn 2 ran less than what is new since turn 1's prompt; without the cache, all
    assert drafter.caught_up - before < len(second) - len(first) and fresh.caught_up == len(second) - 1
    assert drafter.chunk == (None if "@" in name else kernels.MAX_ROWS) and len(second) > kernels.MAX_ROWS


def test_the_catch_up_is_priced_on_what_the_cache_cannot_give() -> None:
    """With 10 ms a catch-up token, a 200-token prompt costs 2 s to catch up on: more than drafting
    its 40 tokens saves (~23 ms a token), so a drafter without the prefix cache does not draft. With
    the same prompt cached (an earlier request's, one token longer), nothing is left to catch up on: it
    drafts, caught up from the cache."""
    prompt = tokens(20, 200)
    outcomes = []
    for budget in (0, 64 * MB):
        drafter = Drafter(target(), prefix=kv_cache(target(), budget) if budget else None)
        member(drafter, prompt + [5]).propose(K)  # an earlier request with the same prompt (no cost: it drafts)
        drafter.times = ForwardTimes(first=0.01, later=0.01, catch_up=0.01)
        for b in drafter.calibration[True].bins:
            b.hits = 0.9 * b.trials
        m = member(drafter, prompt, new=40)
        m.cost = PassCost(seconds=0.05, per_token=0.005, rows=1)
        before = drafter.caught_up
        outcomes.append((len(m.propose(K).tokens) > 0, draft_state(m).cached, drafter.caught_up - before))
    assert outcomes == [(False, 0, 0), (True, len(prompt), 0)]


def test_a_conversation_drafts_from_the_cache_and_decodes_as_plain(tmp_path) -> None:
    """Three turns through the API, the history resent each turn (greedy): every turn's output is
    plain decoding's; from turn 2 on the draft catches up only past the blocks of the previous
    prompt, which the cache gives. With the target's prefix cache
    off (--no-prefix-cache), the draft keeps none either and catches up on every prompt whole."""
    target_dir = tiny_llm_dir(tmp_path / "target", max_position_embeddings=1024)
    draft_dir = tiny_llm_dir(tmp_path / "draft", seed=3, max_position_embeddings=1024)
    spec = SpecConfig("draft", k=K, draft_model=str(draft_dir), adaptive=False)
    params = SamplingParams(max_new_tokens=24)
    runs = {}
    for budget in (None, 0):
        llm = quickdraft.load(str(target_dir), spec=spec, prefix_cache_mb=budget)
        drafter = llm.proposer([1], params, spec).group
        messages = [{"role": "system", "content": "You answer in short sentences, kindly and with care."}]
        caught_up, lengths, drafted = [], [], 0
        for question in ("What is a tree?", "And a forest?", "Why do leaves fall?"):
            messages.append({"role": "user", "content": question})
            before = drafter.caught_up
            out = llm.generate(messages=messages, params=params)
            assert out.token_ids == llm.generate(messages=messages, params=params, spec=SpecConfig(method="none")).token_ids
            caught_up.append(drafter.caught_up - before)
            lengths.append(len(llm.prompt_ids(messages=messages)))
            drafted += out.stats.drafted_tokens
            messages.append({"role": "assistant", "content": out.text})
        runs[budget] = caught_up, lengths, drafted, drafter.prefix
    (cached, lengths, drafted, prefix), (whole, plain_lengths, _, none) = runs[None], runs[0]
    assert drafted > 0 and prefix is not None and none is None and lengths == plain_lengths
    assert cached[0] == lengths[0] and whole == lengths  # the prompt and the first token, all but the newest
    # each turn's prompt starts with the previous one's: its whole blocks, at least, came from the cache (a
    # tiny random model's answer does not survive decoding and re-encoding, so less of it matches)
    assert all(cached[t] <= lengths[t] - BLOCK * (lengths[t - 1] // BLOCK) for t in (1, 2)), (cached, lengths)


def test_drafters_of_one_draft_model_share_one_prefix_cache(tmp_path) -> None:
    """A request may ask for any draft vocabulary, and each gets a drafter of its own: their K/V are
    the same, so they share the draft model's one prefix cache (one each would let a client multiply
    the memory held by choosing vocabularies)."""
    target_dir = tiny_llm_dir(tmp_path / "target")
    draft_dir = tiny_llm_dir(tmp_path / "draft", seed=3)
    llm = quickdraft.load(str(target_dir), prefix_cache_mb=64)
    specs = [SpecConfig("draft", k=K, draft_model=str(draft_dir), options={"draft_vocab": v}) for v in (0, 40, 50)]
    drafters = [llm.proposer([1, 2, 3], SamplingParams(), spec).group for spec in specs]
    assert len({id(d) for d in drafters}) == 3 and len({id(d.prefix) for d in drafters}) == 1
    assert drafters[0].prefix.budget_bytes == llm.prefix.budget_bytes // 4
