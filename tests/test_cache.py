"""KV cache rollback and limits: decode, truncate, decode again gives the same logits as never
having decoded the rolled-back tokens; bad lengths and writes past capacity are refused."""
from __future__ import annotations

import re

import pytest
import torch

from quickdraft.errors import ContextTooLong
from tiny_models import BASE, hf_model, ours_from_hf

VOCAB = BASE["vocab_size"]
MAX_LEN = 48


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_model("llama-gqa-untied"))


def tokens_(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def prefill(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    b, t = tokens.shape
    out = model(tokens, torch.arange(t).expand(b, t), cache)
    cache.truncate([t] * b)
    return out.logits


def decode(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """One token per step for each row, each row at its own committed length; logits [B, n, V]."""
    steps = []
    for s in range(tokens.shape[1]):
        positions = torch.tensor(cache.lengths)[:, None]
        steps.append(model(tokens[:, s:s + 1], positions, cache).logits[:, 0])
        cache.truncate([n + 1 for n in cache.lengths])
    return torch.stack(steps, dim=1)


def test_truncate_then_same_tokens_gives_identical_logits(model):
    prompt, new = tokens_(2, 10, seed=0), tokens_(2, 8, seed=1)
    cache = model.new_cache(2, MAX_LEN)
    prefill(model, prompt, cache)
    first = decode(model, cache, new)
    assert cache.lengths == [18, 18]
    cache.truncate([13, 13])  # roll back the last 5
    again = decode(model, cache, new[:, 3:])
    assert cache.lengths == [18, 18]
    assert torch.equal(again, first[:, 3:])


def test_truncate_then_other_tokens_equals_fresh_run(model):
    prompt, new, other = tokens_(2, 10, seed=2), tokens_(2, 8, seed=3), tokens_(2, 5, seed=4)
    cache = model.new_cache(2, MAX_LEN)
    prefill(model, prompt, cache)
    decode(model, cache, new)
    cache.truncate([13, 13])
    after_rollback = decode(model, cache, other)

    # the same step structure on a cache that never saw the rejected tokens
    fresh = model.new_cache(2, MAX_LEN)
    prefill(model, prompt, fresh)
    decode(model, fresh, new[:, :3])
    assert torch.equal(decode(model, fresh, other), after_rollback)

    # and one full forward over the sequence that was kept
    seq = torch.cat([prompt, new[:, :3], other], dim=1)
    full = model(seq, torch.arange(seq.shape[1]).expand(2, -1), model.new_cache(2, MAX_LEN)).logits
    torch.testing.assert_close(after_rollback, full[:, -other.shape[1]:], atol=1e-5, rtol=0)


def test_rows_rolled_back_by_different_amounts(model):
    """Row 0 drops 1 token, row 1 drops 6; each row then continues at its own position and must
    match that row run alone over the tokens it kept."""
    prompt, new, other = tokens_(2, 10, seed=5), tokens_(2, 8, seed=6), tokens_(2, 4, seed=7)
    cache = model.new_cache(2, MAX_LEN)
    prefill(model, prompt, cache)
    decode(model, cache, new)
    kept = (7, 2)
    cache.truncate([10 + k for k in kept])
    after_rollback = decode(model, cache, other)
    assert cache.lengths == [10 + k + 4 for k in kept]
    for row, k in enumerate(kept):
        seq = torch.cat([prompt[row], new[row, :k], other[row]])[None]
        full = model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, MAX_LEN)).logits
        torch.testing.assert_close(after_rollback[row], full[0, -4:], atol=1e-5, rtol=0)


def test_truncate_validates_lengths(model):
    cache = model.new_cache(2, MAX_LEN)
    for bad in ([3], [3, 3, 3], []):
        with pytest.raises(ValueError, match="expected 2 lengths"):
            cache.truncate(bad)
    for bad in ([-1, 0], [0, MAX_LEN + 1]):
        with pytest.raises(ValueError, match=f"outside 0..{MAX_LEN}"):
            cache.truncate(bad)
    assert cache.lengths == [0, 0]  # a refused truncate changes nothing
    cache.truncate([0, MAX_LEN])  # both ends of the range are allowed
    assert cache.lengths == [0, MAX_LEN]


def test_writing_past_capacity_raises_context_too_long(model):
    cache = model.new_cache(1, 8)
    out = model(tokens_(1, 8, seed=8), torch.arange(8)[None], cache)  # exactly fills it
    assert out.logits.shape == (1, 8, VOCAB)
    message = re.escape("capacity of 8 tokens")
    with pytest.raises(ContextTooLong, match=message):
        model(tokens_(1, 1, seed=9), torch.tensor([[8]]), cache)  # one decode step too many
    with pytest.raises(ContextTooLong, match=message):
        model(tokens_(1, 9, seed=10), torch.arange(9)[None], model.new_cache(1, 8))  # prefill too long
    with pytest.raises(ContextTooLong, match=message):  # one row of a batch past the end
        model(tokens_(2, 1, seed=11), torch.tensor([[3], [8]]), model.new_cache(2, 8))


def test_growing_keeps_each_rows_committed_slots_and_decodes_on_identically(model):
    """reserve() keeps each row's blocks; decoding after a growth gives the logits decoding gives in
    a cache that was large from the start."""
    tokens = tokens_(2, 12, seed=3)
    big = model.new_cache(2, 40)
    small = model.new_cache(2, 12)
    prefill(model, tokens, big)
    prefill(model, tokens, small)
    big.truncate([7, 12])
    small.truncate([7, 12])
    small.reserve(3, 40)
    assert (small.batch_size, small.max_len) == (3, 40)
    assert torch.equal(small.read(0, 0, 7), big.read(0, 0, 7)) and torch.equal(small.read(1, 0, 12), big.read(1, 0, 12))
    assert small.held.tolist() == [1, 1, 0]  # the new row holds no block before it is written
    step = tokens_(2, 1, seed=4)
    small.truncate([7, 12, 0])
    view = small.rows(0, 2)
    assert torch.equal(decode(model, view, step), decode(model, big, step))
