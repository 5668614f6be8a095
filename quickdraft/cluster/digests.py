"""Cheap summaries of token prefixes for routing: one 64-bit digest per block-aligned prefix.

A prompt's i-th digest names its first (i + 1) * BLOCK token ids, chained (each digest is that of
the block before it and the next BLOCK ids), so the prefix cache's blocks and a prompt's prefixes
get the same numbers, and a replica advertises what it holds as a set of integers, never the
tokens. A collision (2^-64) costs a routing choice, never an answer: the replica matches on ids.
Knows the prefix cache's block size; nothing of Ray.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

from quickdraft.kv.prefix_cache import BLOCK, PrefixCache

ROOT = 0  # the empty prefix's digest
MAX_ADVERTISED = 1 << 16  # digests a replica advertises at most (~3,000 blocks fill the default budget on SmolLM2)


def chain(above: int, block: Sequence[int]) -> int:
    """The digest of a prefix whose first len - BLOCK tokens have digest `above` and whose last are `block`."""
    data = above.to_bytes(8, "little") + array("q", block).tobytes()
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def prompt_digests(ids: Sequence[int]) -> list[int]:
    """The digests of every whole block of `ids`, shortest prefix first."""
    out, digest = [], ROOT
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        digest = chain(digest, ids[start:start + BLOCK])
        out.append(digest)
    return out


def held_digests(cache: PrefixCache | None) -> list[int]:
    """The digests of the prefixes `cache` holds (at most MAX_ADVERTISED of them)."""
    return [] if cache is None else cache.fold(chain, ROOT)[:MAX_ADVERTISED]

