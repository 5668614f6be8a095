"""The prefix cache's tests' pieces: a cache for a model, random tokens and random K/V (test_prefix_cache's)."""
from __future__ import annotations

import torch

from quickdraft.kv.blocks import BlockPool
from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer

MODEL = "llama-gqa-untied"
MB = 1 << 20


def prefix_for(model: Transformer, budget: int = 64 * MB) -> PrefixCache:
    return PrefixCache(budget, model.config, model.compute_dtype,
                       pool=BlockPool(model.config, model.compute_dtype, model.device))


def tokens(seed: int, n: int, vocab: int = 96) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_cache(model: Transformer, rows: int, length: int, seed: int) -> KVCache:
    cache = model.new_cache(rows, length)
    g = torch.Generator().manual_seed(seed)
    c = model.config
    for row in range(rows):
        cache.write_rows(row, 0, torch.randn(c.num_layers, 2, c.num_kv_heads, length, c.head_dim, generator=g))
    return cache


SYSTEM = tokens(6, 37)  # a "system prompt" several sessions share
CONVERSATION = [
    # (prompt, proposer, k, join at step): sessions sharing SYSTEM, then their next turns resent whole
    (SYSTEM + [5, 6, 7, 8, 5, 6, 7, 8], None, 0, 0),
    (SYSTEM + [9, 2, 9, 2, 9, 2], "ngram", 4, 0),
    (SYSTEM + [44, 12, 19, 44, 12], "draft_same", 3, 1),
    (SYSTEM + [5, 6, 7, 8, 5, 6, 7, 8] + tokens(7, 20), "draft_random", 2, 6),
    (SYSTEM + [9, 2, 9, 2, 9, 2] + tokens(8, 30), "ngram", 8, 9),
    (tokens(9, 50), "ngram", 1, 12),  # shares nothing
    (SYSTEM + [44, 12, 19, 44, 12] + tokens(10, 17), None, 0, 14),
]
