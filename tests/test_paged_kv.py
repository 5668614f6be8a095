"""K/V in blocks (kv/blocks.py, kv/cache.py): rows take blocks as they are written, give them back
when released or moved, a block shared with another holder is never written, and the pool grows
without losing what its blocks hold."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.kv import blocks as blocks_module
from quickdraft.kv.blocks import BLOCK, BlockPool, physical_memory
from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.spec.sampling import SamplingParams
from support.process import vm_rss_mb
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


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "allocated"])
def test_the_pool_grows_keeping_every_block_and_reuses_freed_ones_first(reserved, monkeypatch) -> None:
    """Reserved (the CPU's): growing moves nothing; allocated (CUDA's): by doubling, blocks copied."""
    if not reserved:
        monkeypatch.setattr(blocks_module, "reservation", lambda *args: None)
    config = ours_from_hf(hf_model("llama-gqa-untied")).config
    pool = BlockPool(config, blocks=2)
    assert pool.reserved == reserved and pool.in_memory == (0 if reserved else 2)
    first = pool.alloc(2)
    pool.kv[:, :, :, first] = 7.0
    kv = pool.kv
    more = pool.alloc(5)  # past the room it was made with
    assert (pool.kv is kv) == reserved and pool.in_memory == 7
    assert pool.blocks >= 8 and (pool.kv[:, :, :, first] == 7.0).all() and pool.used == 7
    pool.decref([more[1], more[3], more[0]])
    assert pool.alloc(2) == [more[0], more[1]] and pool.used == 6  # the first run of freed ones
    with pytest.raises(ValueError, match="not held"):
        pool.decref([0])
    pool.reserve(20)
    with pytest.raises(ValueError, match="not held"):
        pool.incref([pool.high])  # never handed out


def test_rows_are_handed_consecutive_blocks_where_free_ones_allow() -> None:
    """The kernels read a row of consecutive block ids as one stretch (faster): a row grows right
    after its last block where those are free, a new row takes the first run of free ids long
    enough, else the lowest; fresh ids only past the free ones (the memory stays bounded). Handing
    the most recently freed first broke every row after the first (the last block went first)."""
    pool = BlockPool(SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8, hidden_size=8))
    for _ in range(3):  # one request after another: prefill, then a block more while decoding
        table = pool.alloc(6)
        table += pool.alloc(1, after=table[-1])
        assert table == list(range(1, 8)) and pool.in_memory == 7
        pool.decref(reversed(table))  # in any order
    a, b = pool.alloc(3), pool.alloc(3)                     # [1, 2, 3], [4, 5, 6]; 7 free
    assert b == [4, 5, 6] and pool.alloc(1, after=a[-1]) == [7]  # 4 is b's: not after a, the lowest free
    pool.decref(a)                                          # free: 1, 2, 3
    assert pool.alloc(2, after=0) == [1, 2]                 # right after the null block
    assert pool.alloc(2) == [3, 8] and pool.in_memory == 8  # past the free ones: fresh
    pool.decref([1, 4, 5, 2])                               # free: 1, 2, 4, 5
    assert pool.alloc(2, after=3) == [4, 5] and pool.alloc(2, after=6) == [1, 2]
    assert pool.alloc(0, after=1) == [] and pool.free == []
    pool.decref([1, 4, 5])                                  # free: 1, 4, 5
    assert pool.alloc(2) == [4, 5]                          # the first run of two, not the lowest two


def test_a_growing_row_takes_the_block_after_its_last(model) -> None:
    """Through the cache: a row that grows asks for the ids after its last block, so it stays one
    stretch where a lower free id would have broken it."""
    cache = model.new_cache(3, 64)
    for row in range(3):
        fill(model, cache, row, 16, seed=row)               # a block each: 1, 2, 3
    cache.release(0)
    cache.release(2)                                        # free: 1, 3
    tokens = torch.randint(0, BASE["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(9))
    model(tokens, torch.arange(16, 32)[None], cache.rows(1, 2))
    assert cache.tables[1, :2].tolist() == [2, 3]


def test_a_reservation_outgrown_doubles_what_is_used(monkeypatch) -> None:
    """Past its reservation a pool is allocated at twice its used blocks (not twice the reservation,
    the machine's memory), every block kept."""
    monkeypatch.setattr(blocks_module, "MAX_RESERVED_BLOCKS", 4)
    pool = BlockPool(ours_from_hf(hf_model("llama-gqa-untied")).config)
    assert pool.reserved and pool.blocks == 4
    first = pool.alloc(3)
    pool.kv[:, :, :, first] = 5.0
    more = pool.alloc(2)  # 6 blocks with the null one: past the reservation
    assert not pool.reserved and pool.blocks == 8 and (pool.kv[:, :, :, first] == 5.0).all()
    assert more == [4, 5] and pool.in_memory == 7


def test_a_reserved_pool_takes_memory_only_for_the_blocks_written() -> None:
    """The 1.5B's pool reserves the machine's memory in blocks of 0.9 MB; writing 200 of them costs
    their pages alone, in 4 KB pages (no huge page zeroed past them), and fresh blocks read zero."""
    shape = SimpleNamespace(num_layers=28, num_kv_heads=2, head_dim=128, hidden_size=1536)
    pool = BlockPool(shape)
    if not pool.reserved:
        pytest.skip("this machine gives no reservation (strict overcommit, ulimit -v, or not Linux on x86-64/arm64)")
    assert pool.blocks * pool.block_bytes >= physical_memory() // 2
    before = vm_rss_mb()
    ids = pool.alloc(200)
    pool.kv[:, :, :, ids] = 1.0
    grown = vm_rss_mb() - before
    assert 0.9 * 200 * pool.block_bytes / 2**20 < grown < 1.2 * 200 * pool.block_bytes / 2**20 + 8, grown
    assert pool.kv[:, :, :, pool.alloc(1)].abs().sum() == 0


def test_a_cache_over_a_given_pool_draws_its_blocks_there(model) -> None:
    pool = BlockPool(model.config)
    a, b = KVCache(pool, 1, 40), KVCache(pool, 2, 40)
    fill(model, a, 0, 20)
    fill(model, b, 1, 33)
    assert pool.used == 2 + 3 and set(a.tables[0, :2].tolist()).isdisjoint(b.tables[1, :3].tolist())
    assert a.pool.block_bytes == model.config.num_layers * 2 * model.config.num_kv_heads * BLOCK * \
        model.config.head_dim * 4


# -- rows sharing the prefix cache's blocks -----------------------------------------------------------

def refcounts_agree(engine: Engine) -> bool:
    """Every block's reference count is the number of its holders: trie nodes and cache rows."""
    want = np.zeros(len(engine.cache.pool.refs), np.int64)
    want[0] = 1
    for node in engine.prefix._nodes():
        want[node.block] += 1
    for row in range(engine.cache.batch_size):
        np.add.at(want, engine.cache.tables[row, :engine.cache.held[row]].numpy(), 1)
    return np.array_equal(want, engine.cache.pool.refs)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def until_decoding(engine: Engine, n: int) -> None:
    """Steps until n rows decode, none waiting or filling."""
    for _ in range(200):
        if len(engine.rows) == n and engine.filling is None and not engine.waiting:
            return
        for _, event in engine.step():
            assert event.error is None, event.error
    raise AssertionError("the rows never all decoded")


@pytest.fixture(scope="module")
def long_model() -> Transformer:
    return ours_from_hf(hf_model("llama-gqa-untied", max_position_embeddings=2048))


@pytest.mark.parametrize("cached", [True, False])
def test_sessions_behind_one_system_prompt_hold_it_once(long_model, cached: bool) -> None:
    """Issue 46's measure: 8 sessions sent together behind one 1,500-token system prompt (93 blocks
    and 12 tokens) hold its K/V once: the first to fill offers it to the prefix cache as it starts
    decoding, the 7 after it share its 93 blocks (the same ids in every table), and the pool holds
    those, each row's own 2 (the partial block's 12 tokens, 5 of its own, 8 new) and the trie's
    copies of the partial blocks. Without a prefix cache each row holds a copy."""
    system = prompt(0, 1500)
    prefix = PrefixCache(256 << 20, long_model.config, long_model.compute_dtype) if cached else None
    # A fixed prefill allowance past all 8 prompts: a measured one (the default) feeds the uncached
    # prompts so slowly beside the decoding rows that the first end before the last is admitted.
    engine = Engine(long_model, EngineConfig(max_batch=8, prefill_chunk=1 << 14), prefix=prefix)
    for i in range(8):
        engine.add(Request(system + prompt(10 + i, 5), SamplingParams(max_new_tokens=8, ignore_eos=True), id=str(i)))
    until_decoding(engine, 8)
    heads = {tuple(engine.cache.tables[r, :93].tolist()) for r in range(8)}
    pool = engine.cache.pool
    if cached:
        assert len(heads) == 1 and sorted(engine.rows[r].stats.cached_tokens for r in range(8)) == [0] + [1500] * 7
        assert pool.used <= 93 + 8 * 2 + 8  # 8 copies would be 760
        assert refcounts_agree(engine)
    else:
        assert len(heads) == 8 and pool.used >= 8 * 94


def test_choices_of_one_prompt_share_its_blocks(model) -> None:
    """n = 4 answers to one 70-token prompt (4 blocks and 6 tokens), admitted together: the first
    one's prompt is offered whole when the next is admitted, the other three share its 4 blocks."""
    prefix = PrefixCache(64 << 20, model.config, model.compute_dtype)
    engine = Engine(model, EngineConfig(max_batch=4, prefill_chunk=1024), prefix=prefix)
    ask = prompt(3, 70)
    for i in range(4):
        engine.add(Request(ask, SamplingParams(max_new_tokens=20, temperature=1.0, seed=i), id=str(i)))
    until_decoding(engine, 4)
    assert len({tuple(engine.cache.tables[r, :4].tolist()) for r in range(4)}) == 1
    assert engine.cache.pool.used <= 4 + 1 + 4 * 3  # the prompt's blocks, its tail, each row's own
    assert refcounts_agree(engine)
    while engine.has_work():
        engine.step()
    assert refcounts_agree(engine)
    engine.cache.release_all()
    while prefix._nodes():
        for node in [n for n in prefix._nodes() if not n.children]:
            prefix._drop(node)
    assert engine.cache.pool.used == 0  # every block back once no row and no node holds it


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_attention_reads_any_block_order_with_the_bits_of_one_contiguous_row(head_dim: int) -> None:
    """The kernel reads a row whose blocks are consecutive ids as one stretch (attention.c's
    span_slots) and any other row block by block: the same outputs, bit for bit, as contiguous
    rows, causal and under a mask, for the first row of a table and the next."""
    from quickdraft.kernels import rope_attention
    from quickdraft.kernels.pages import Pages
    B, T, n_q, n_kv, D = 2, 70, 4, 2, head_dim
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, (n_q + 2 * n_kv) * D, generator=g)
    angles = torch.arange(T)[:, None] * (0.01 * torch.arange(D)[None])
    cos, sin = angles.cos()[None, None].expand(B, 1, T, D), angles.sin()[None, None].expand(B, 1, T, D)
    positions = torch.arange(T).expand(B, T)
    visible = torch.rand(B, T, T, generator=g) < 0.7
    visible = (visible & torch.ones(T, T, dtype=torch.bool).tril()) | torch.eye(T, dtype=torch.bool)
    n = (T + BLOCK - 1) // BLOCK  # blocks a row
    first, second = torch.arange(1, n + 1), torch.arange(n + 1, 2 * n + 1)
    orders = {"consecutive": (first, second), "reversed": (first.flip(0), second.flip(0)),
              "one gap": (torch.cat([first[:-1], torch.tensor([2 * n + 1])]), second),
              "interleaved": (torch.arange(1, 2 * n + 1, 2), torch.arange(2, 2 * n + 1, 2))}
    for mask in (None, visible.to(torch.uint8)):
        k, v = torch.zeros(B, n_kv, T, D), torch.zeros(B, n_kv, T, D)
        want = rope_attention(qkv, cos, sin, positions, Pages.rows(B, T), k, v, mask, T, n_q, n_kv)
        for name, rows in orders.items():
            pool = torch.zeros(2, n_kv, 2 * n + 2, BLOCK, D)  # the pool's layout: heads before blocks
            pages = Pages(torch.stack(rows).to(torch.int32).contiguous(), BLOCK, 2 * n + 2, T)
            got = rope_attention(qkv, cos, sin, positions, pages, pool[0].transpose(0, 1), pool[1].transpose(0, 1),
                                 mask, T, n_q, n_kv)
            assert torch.equal(got, want), (name, mask is None)
