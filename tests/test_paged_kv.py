"""K/V in blocks (kv/blocks.py, kv/cache.py): rows take blocks as they are written, give them back
when released or moved, a block shared with another holder is never written, and the pool grows
without losing what its blocks hold."""
from __future__ import annotations

import pytest
import torch

from quickdraft.kv.blocks import BLOCK, BlockPool
from quickdraft.kv.cache import KVCache
from tiny_models import BASE, hf_model, ours_from_hf


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_model("llama-gqa-untied"))


def fill(model, cache, row: int, n: int, seed: int = 0) -> None:
    tokens = torch.randint(0, BASE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))
    model(tokens, torch.arange(n)[None], cache.rows(row, row + 1))
    cache.lengths[row] = n


def test_rows_take_blocks_as_they_are_written_and_give_them_back(model) -> None:
    cache = model.new_cache(3, 100)
    assert cache.pool.used == 0  # room reserved, nothing held
    fill(model, cache, 0, 40)
    fill(model, cache, 1, 5)
    assert cache.held.tolist() == [3, 1, 0] and cache.pool.used == 4
    assert len({*cache.tables[0, :3].tolist(), cache.tables[1, 0].item()}) == 4 and 0 not in cache.tables[0, :3]
    kept = cache.read(0, 0, 40)
    cache.move_row(0, 1)  # row 0 ends, row 1's blocks go back, row 0's become row 1's: no K/V moves
    assert cache.held.tolist() == [0, 3, 0] and cache.pool.used == 3 and cache.lengths[:2] == [0, 40]
    assert torch.equal(cache.read(1, 0, 40), kept)
    cache.release(1)
    assert cache.pool.used == 0 and not cache.tables.any()


def test_a_forward_never_writes_into_a_shared_block(model) -> None:
    cache = model.new_cache(1, 64)
    fill(model, cache, 0, 20)  # blocks 0-15 | 16-19
    cache.pool.incref(cache.tables[0, :1].tolist())  # the first block is another holder's too
    with pytest.raises(ValueError, match="another row or the prefix cache shares"):
        fill(model, cache, 0, 3)  # would rewrite slots 0-2


def test_appending_past_a_shared_prefix_is_allowed(model) -> None:
    cache = model.new_cache(1, 64)
    fill(model, cache, 0, 16)
    cache.pool.incref(cache.tables[0, :1].tolist())
    token = torch.tensor([[5]])
    model(token, torch.tensor([[16]]), cache)  # slot 16: a block of the row's own
    assert cache.held[0] == 2


def test_the_pool_grows_keeping_every_block_and_reuses_freed_ones_first() -> None:
    config = ours_from_hf(hf_model("llama-gqa-untied")).config
    pool = BlockPool(config, blocks=2)
    first = pool.alloc(2)
    pool.kv[:, :, :, first] = 7.0
    more = pool.alloc(5)  # past its room: doubled, first's contents kept
    assert pool.blocks >= 8 and (pool.kv[:, :, :, first] == 7.0).all() and pool.used == 7
    pool.decref([more[1], more[3], more[0]])
    assert pool.alloc(2) == [more[0], more[3]] and pool.used == 6  # the last two freed (warm), ascending
    with pytest.raises(ValueError, match="not held"):
        pool.decref([0])
    pool.reserve(20)
    with pytest.raises(ValueError, match="not held"):
        pool.incref([pool.high])  # never handed out


def test_a_cache_over_a_given_pool_draws_its_blocks_there(model) -> None:
    pool = BlockPool(model.config)
    a, b = KVCache(pool, 1, 40), KVCache(pool, 2, 40)
    fill(model, a, 0, 20)
    fill(model, b, 1, 33)
    assert pool.used == 2 + 3 and set(a.tables[0, :2].tolist()).isdisjoint(b.tables[1, :3].tolist())
    assert a.pool.block_bytes == model.config.num_layers * 2 * model.config.num_kv_heads * BLOCK * \
        model.config.head_dim * 4
