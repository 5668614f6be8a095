"""PrefixCache: the target's K/V of token prefixes, kept across requests under a byte budget.

A trie of fixed-size blocks (SGLang's radix tree with edges cut into BLOCK tokens): a node holds
the K/V of BLOCK tokens whose whole prefix is the path to it, so any request that starts with the
same tokens (a resent chat history, a system prompt shared by many sessions) finds them. A stored
sequence's last, shorter piece is a leaf of fewer tokens (a tail), and a match goes on into the
child that shares the most next tokens, a tail or a block: a chat's next turn finds every token of
the last one, not all but its last 0-15 (they were a tenth of a turn's new tokens). Matching is on
token ids only, within a scope.

Scopes keep clients apart (docs/server.md, "Who shares the prefix cache"): each has a trie of its own,
so a request finds only what requests of its scope stored, and neither its cached_tokens nor its time
to first token tells it what another scope sent. Unused leaves are evicted least recently used first
(a tail counts as a block), from the scope that holds the most blocks, counting those a store wants:
a scope holding less than another never loses blocks to it, so one client's long prompts evict their
own prefixes before another's, and the budget is shared evenly among the scopes that fill it.

A node is a block of the K/V pool (kv/blocks.py) its rows draw from: a hit shares the matched
blocks with the row (`fetch`: ids into its table, a reference each; only a last, partly matched
block is copied, <= 15 tokens), and a row's full blocks join the trie by reference when its prompt
is in and when it ends (`store`; a tail is copied into a block of its own). Shared blocks are full
and below every holder's length, so no one writes them; evicting a node gives back the trie's
reference, and the block is free once no row holds it either. A cache whose rows lie in another
pool (a test's, a cache passed in) has its blocks copied in and out instead. Features, where kept,
are copied ([16, D] a block: a 4,000-token row's whole store took 8 ms of SmolLM2's, engine/placement.py).

A draft model's Drafter keeps one of its own, of K/V only (proposers/drafter.py).

Knows nothing of requests or when rows start and end (the engine decides). A lock lets the
engines of several threads (the server's, `LLM.generate` called beside it) share one cache per
model; each call holds it for a copy of at most one prompt's K/V.
"""
from __future__ import annotations

import heapq
import itertools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from quickdraft.kv.cache import BLOCK, BlockPool, KVCache, KVShape  # BLOCK: tokens per node (a tail: fewer)
from quickdraft.spec.sequences import common_prefix

DEFAULT_MB = 2048  # budget unless asked otherwise, at most an eighth of the machine's memory
T = TypeVar("T")


def default_budget_mb() -> int:
    try:
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    except (ValueError, OSError, AttributeError):  # no sysconf: not Linux or macOS
        return DEFAULT_MB
    return max(1, min(DEFAULT_MB, memory_mb // 8))


@dataclass(eq=False)
class _Node:
    block: int | None                             # its pool block (the first len(key) slots); None at the root
    features: torch.Tensor | None                 # [n, F] the model's features (draft heads read
                                                  # them); None at the root and in a cache of K/V only
    parent: "_Node | None"
    scope: str                                    # whose: requests of this scope find it (the root's too)
    key: tuple[int, ...]                          # the token ids this node holds: BLOCK, or fewer (a tail,
                                                  # always a leaf)
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    used: int = 0                                 # tick of its last match or store (LRU)


@dataclass
class PrefixStats:
    hit_tokens: int = 0      # prompt tokens whose K/V came from the cache
    miss_tokens: int = 0     # prompt tokens prefilled
    evictions: int = 0       # blocks evicted to stay within the budget
    bytes: int = 0           # bytes of K/V held now
    blocks: int = 0          # blocks held now
    scopes: dict[str, int] = field(default_factory=dict)  # blocks held now, per scope that holds any


class PrefixCache:
    def __init__(self, budget_bytes: int, config: KVShape, dtype: torch.dtype, feature_width: int | None = None,
                 pool: BlockPool | None = None) -> None:
        """budget_bytes: bytes of K/V and features held at most; dtype: the K/V cache's; feature_width:
        the features kept per token beside the K/V (the model's `feature_width`; None: the last
        layer's output, hidden_size; 0: none, a draft model's cache keeps K/V only: `fetch_kv`);
        pool: the blocks of the model's rows (None: a pool of its own, on the CPU)."""
        self.config, self.dtype = config, dtype
        self.feature_width = config.hidden_size if feature_width is None else feature_width
        self.features = self.feature_width > 0
        self.pool = pool if pool is not None else BlockPool(config, dtype)
        self.block_bytes = self.block_size(config, dtype, self.feature_width)
        if budget_bytes < self.block_bytes:
            raise ValueError(f"the prefix cache's budget ({budget_bytes:,} bytes) is below one block of "
                             f"{BLOCK} tokens ({self.block_bytes:,} bytes for this model)")
        self.budget_bytes = budget_bytes
        self.roots: dict[str, _Node] = {}  # per scope, its trie's root (made at its first store)
        self.stats = PrefixStats()
        self._tick = itertools.count(1)
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding the lock (a store from it must not wait for itself)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def keep_features(self, width: int) -> None:
        """Keep `width` features per token from now on (the model keeps more layers' outputs for a
        draft head); only while nothing is stored, so every block holds one width."""
        if not self.features or self.roots:
            raise ValueError("a prefix cache changes its features' width only while it keeps features and holds nothing")
        self.feature_width, self.block_bytes = width, self.block_size(self.config, self.dtype, width)

    @staticmethod
    def block_size(config: KVShape, dtype: torch.dtype, feature_width: int | None = None) -> int:
        """Bytes one block holds: BLOCK tokens' K/V of every layer, and their features (as __init__'s)."""
        width = config.hidden_size if feature_width is None else feature_width
        per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim + width
        return BLOCK * per_token * dtype.itemsize

    def fetch(self, tokens: Sequence[int], limit: int, cache: KVCache, row: int, scope: str = ""
              ) -> torch.Tensor | None:
        """Copy the K/V of the longest prefix of `tokens[:limit]` that `scope` holds into slots 0..
        of `row` and count the hit; its features [n, F], None if nothing matched."""
        with self._locked():
            path = self._copy_in(tokens, limit, cache, row, scope)
            return torch.cat([node.features[:n] for node, n in path]) if path else None

    def fetch_kv(self, tokens: Sequence[int], limit: int, cache: KVCache, row: int, scope: str = "") -> int:
        """`fetch` for a cache without features: how many tokens' K/V it copied."""
        with self._locked():
            return sum(n for _, n in self._copy_in(tokens, limit, cache, row, scope))

    def hit(self, tokens: Sequence[int], limit: int, scope: str = "") -> int:
        """How many tokens of `tokens[:limit]` a fetch would give now; copies nothing."""
        with self._locked():
            return sum(n for _, n in self.match(tokens, limit, scope))

    def _copy_in(self, tokens: Sequence[int], limit: int, cache: KVCache, row: int, scope: str
                 ) -> list[tuple[_Node, int]]:
        """Match, copy the path's K/V into `row`, count the hit (the lock held)."""
        path = self.match(tokens, limit, scope)
        if path:
            self.copy(path, cache, row)
        hit = sum(n for _, n in path)
        self.stats.hit_tokens += hit
        self.stats.miss_tokens += len(tokens) - hit
        return path

    def match(self, tokens: Sequence[int], limit: int, scope: str = "") -> list[tuple[_Node, int]]:
        """The longest prefix of `tokens[:limit]` that `scope` holds: whole blocks, then the first n
        tokens of the child that shares the most next ones (a tail, or a block that goes another
        way), as (node, tokens of it matched)."""
        path, node = [], self.roots.get(scope)
        if node is None:
            return []
        tick = next(self._tick)
        start = 0
        while start + BLOCK <= limit and (child := node.children.get(tuple(tokens[start:start + BLOCK]))):
            node, start = child, start + BLOCK
            node.used = tick
            path.append((node, BLOCK))
        ahead = tokens[start:limit]
        best, shared = None, 0
        for child in node.children.values():
            n = common_prefix(child.key, ahead)
            if n > shared:
                best, shared = child, n
        if best is not None:
            best.used = tick
            path.append((best, shared))
        return path

    def copy(self, path: Sequence[tuple[_Node, int]], cache: KVCache, row: int) -> None:
        """A matched path's K/V as slots 0.. of `row` (whose blocks go back first): its whole
        blocks shared, a last partial one copied; all copied where the row lies in another pool."""
        assert path, "nothing to load"
        if cache.pool is self.pool:
            whole = [node.block for node, n in path if n == BLOCK]
            part = [(node.block, n) for node, n in path if n < BLOCK]
            cache.share(row, whole, part[0] if part else None)
        else:
            kv = self.pool.kv
            cache.release(row)
            cache.write_rows(row, 0, torch.cat([kv[:, :, :, node.block, :n] for node, n in path], dim=3).to(
                cache.pool.kv.device))  # [L, 2, Hkv, n, hd]

    def store(self, tokens: Sequence[int], cache: KVCache, row: int, features: torch.Tensor | None = None,
              scope: str = "") -> None:
        """Keep the K/V of the first len(features) `tokens` (slots 0.. of `row`), with their
        features [n, F] (a cache without features: of all `tokens`), in blocks and a tail; blocks
        already held are only marked used. Less is kept where the budget cannot make room; none
        where this thread is inside a call already (a stream that the garbage collector closes in
        the middle of one offers its tokens: waiting for the lock would wait for itself).
        `scope`: whose they are (only its requests find them)."""
        assert (features is not None) == self.features, "features are kept by a cache made to keep them, only"
        assert features is None or features.shape[-1] == self.feature_width, "features of the cache's width"
        if self._owner == threading.get_ident():
            return
        with self._locked():
            self._store(tokens, cache, row, features, scope)

    def _store(self, tokens: Sequence[int], cache: KVCache, row: int, features: torch.Tensor | None,
               scope: str) -> None:
        length = len(tokens) if features is None else features.shape[0]
        node = root = self.roots.get(scope) or _Node(None, None, None, scope, ())
        tick, start = next(self._tick), 0
        while start + BLOCK <= length and tuple(tokens[start:start + BLOCK]) in node.children:
            node = node.children[tuple(tokens[start:start + BLOCK])]
            node.used, start = tick, start + BLOCK
        blocks = (length - start) // BLOCK
        tail = length - start - blocks * BLOCK
        for child in node.children.values() if tail and not blocks else ():
            if common_prefix(child.key, tokens[start:length]) == tail:  # held already, in a tail or a block
                child.used, tail = tick, 0
                break
        room = self._make_room(blocks + (tail > 0), node)
        for _ in range(min(blocks, room)):
            node, start = self._add(node, tokens[start:start + BLOCK], cache, row, start, features, tick), start + BLOCK
        if tail and room > blocks:
            self._add(node, tokens[start:start + tail], cache, row, start, features, tick)
        if root.children:  # (a scope's root goes when its last block does: _drop)
            self.roots[scope] = root

    def _add(self, parent: _Node, key: Sequence[int], cache: KVCache, row: int, start: int,
             features: torch.Tensor | None, tick: int) -> _Node:
        """A child of `parent` holding slots start.. of `row` for tokens `key`; tails it covers go."""
        key = tuple(key)
        for other in [c for c in parent.children.values() if len(c.key) < len(key) and c.key == key[:len(c.key)]]:
            self._drop(other)
        end = start + len(key)
        if cache.pool is self.pool and len(key) == BLOCK:
            block = int(cache.tables[row, start // BLOCK])
            self.pool.incref([block])
        else:  # a tail (the row goes on writing its block), or a row in another pool: a copy
            block = self.pool.alloc(1)[0]
            if cache.pool is self.pool:
                self.pool.copy(int(cache.tables[row, start // BLOCK]), block, len(key))
            else:
                self.pool.kv[:, :, :, block, :len(key)] = cache.read(row, start, end).to(self.pool.kv.device)
        kept = None if features is None else features[start:end].clone()
        parent.children[key] = node = _Node(block, kept, parent, parent.scope, key, used=tick)
        self.stats.blocks += 1
        self.stats.bytes += self.block_bytes
        self.stats.scopes[node.scope] = self.stats.scopes.get(node.scope, 0) + 1
        return node

    def _make_room(self, blocks: int, protect: _Node) -> int:
        """Evict least recently used leaves until `blocks` more fit, each from the scope that holds
        the most (protect's scope counting the blocks that fit so far and the next; on a tie,
        protect's: what is held stays), never `protect` or its ancestors (the path being stored);
        how many fit then."""
        def fit() -> int:
            return min(blocks, (self.budget_bytes - self.stats.bytes) // self.block_bytes)
        if fit() == blocks:
            return blocks
        keep = set()
        scope = protect.scope
        while protect is not None:
            keep.add(id(protect))
            protect = protect.parent
        heaps: dict[str, list[tuple[int, int, _Node]]] = {}
        for n in self._nodes():
            if not n.children and id(n) not in keep:
                heaps.setdefault(n.scope, []).append((n.used, id(n), n))
        for heap in heaps.values():
            heapq.heapify(heap)
        while fit() < blocks:
            held = self.stats.scopes
            own = held.get(scope, 0) + fit() + 1  # what the storing scope would hold with one block more
            victim = max([*held, scope], key=lambda s: (own if s == scope else held[s], s == scope))
            if not heaps.get(victim):
                break  # what it holds is the path being stored: the rest is not kept
            leaf = heapq.heappop(heaps[victim])[2]
            self._evict(leaf)
            parent = leaf.parent
            if parent.block is not None and not parent.children and id(parent) not in keep:
                heapq.heappush(heaps[victim], (parent.used, id(parent), parent))  # now a leaf itself
        return fit()

    def _evict(self, node: _Node) -> None:
        self._drop(node)
        self.stats.evictions += 1

    def _drop(self, node: _Node) -> None:
        del node.parent.children[node.key]
        self.pool.decref([node.block])
        node.block = node.features = None
        self.stats.blocks -= 1
        self.stats.bytes -= self.block_bytes
        self.stats.scopes[node.scope] -= 1
        if not self.stats.scopes[node.scope]:
            del self.stats.scopes[node.scope]
            self.roots.pop(node.scope, None)  # memory for the scopes that hold blocks only

    def fold(self, step: Callable[[T, tuple[int, ...]], T], root: T) -> list[T]:
        """`step` folded down every cached path from `root`: one value per node held (blocks and tails),
        each from its parent's value and its token ids (a replica's summary of what it holds, cluster/)."""
        with self._locked():
            out, todo = [], [(node, root) for top in self.roots.values() for node in top.children.values()]
            while todo:
                node, above = todo.pop()
                out.append(value := step(above, node.key))
                todo.extend((child, value) for child in node.children.values())
            return out

    def _nodes(self) -> list[_Node]:
        out, todo = [], [node for root in self.roots.values() for node in root.children.values()]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out
