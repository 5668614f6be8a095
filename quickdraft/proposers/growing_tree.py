"""A tree draft while it grows, as EAGLE-2's dynamic trees are grown by the draft model
(drafter.py) and the draft head (head.py): nodes with their parents, probabilities and the chance
of reaching them, the cache slots of the nodes run, and each level's attention mask."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class GrowingTree:
    """A tree draft while it grows: per node its token, parent (-1: the root), the draft's
    probability of it given its parent, the product of those along its path (reach) and of their
    calibrated acceptance (chance), its depth (1: a child of the root), and the cache slot of each
    node run so far."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.reach: list[float] = []
        self.chance: list[float] = []  # per node, the chance its path is accepted (calibrated)
        self.depth: list[int] = []
        self.slot: dict[int, int] = {}

    def grow(self, parents: Sequence[int], probs: Sequence[Sequence[float]], ids: Sequence[Sequence[int]],
             estimate: Callable[[float], float] = lambda p: p) -> list[int]:
        """Children for each of `parents` (their tokens `ids`, probabilities `probs`; `estimate`:
        a probability -> the chance the target accepts the token) -> the new nodes."""
        new = []
        for parent, ps, xs in zip(parents, probs, ids):
            for p, x in zip(ps, xs):
                new.append(len(self.tokens))
                self.tokens.append(x)
                self.parents.append(parent)
                self.probs.append(p)
                self.reach.append(p * (self.reach[parent] if parent >= 0 else 1.0))
                self.chance.append(estimate(p) * (self.chance[parent] if parent >= 0 else 1.0))
                self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        return new

    def visible(self, nodes: Sequence[int], committed: int) -> torch.Tensor:
        """[len(nodes), slot of the last + 1]: each node sees the committed slots, its ancestors and itself."""
        seen = torch.zeros(len(nodes), self.slot[nodes[-1]] + 1, dtype=torch.bool)
        seen[:, :committed] = True
        for j, n in enumerate(nodes):
            while n >= 0:
                seen[j, self.slot[n]] = True
                n = self.parents[n]
        return seen

    def path(self, node: int) -> list[int]:
        """The tokens from the root's first child down to `node` (-1, the root: none)."""
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def likeliest(self, k: int) -> tuple[list[int], list[int]]:
        """The k nodes likeliest to be reached, likeliest first (a child is never likelier than its
        parent: every prefix is a tree), and each one's parent as an index into them (-1: the root)."""
        keep = sorted(range(len(self.tokens)), key=lambda n: (-self.reach[n], self.depth[n]))[:k]
        index = {n: i for i, n in enumerate(keep)}
        return keep, [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep]

    def spine(self, nodes: Sequence[int]) -> list[int]:
        """Of `nodes` (a tree), the path that takes the likeliest child at every level."""
        path, parent = [], -1
        while children := [n for n in nodes if self.parents[n] == parent]:
            parent = max(children, key=lambda n: self.probs[n])
            path.append(parent)
        return path
