"""The target's logits at the positions a decode pass fed, computed only as far as verification
reaches: the transformer layers must see every fed token, but the LM head (15-18% of a pass on
the packaged models) decides only at the root and the accepted path's nodes. A row's first
positions are scored before verifying (how many: policy.first_scored); a row whose walk reaches
a node past them has that node's subtree scored and is verified again, its generator rewound.

Exact: every position's logits are the numbers a head over all positions gives (the head's
kernels give each row the same bits whatever rows share a call of at most kernels.MAX_ROWS rows,
and no call here scores more), the walk reads only the positions on its path, and a sampled
row's generator draws the same numbers whatever positions hold (verify.py draws by shape), so
the verdict is bitwise the one full scoring gives. Positions never scored hold zeros, which no walk reads.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from quickdraft.kernels import MAX_ROWS
from quickdraft.spec.draft_contract import Draft
from quickdraft.spec.sampling import SamplingParams
from quickdraft.spec.verify import Verdict, verify


class Scores:
    """Row b's logits at its fed positions (0: the root, 1+i: node i), scored on demand."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], features: torch.Tensor,
                 index: torch.Tensor | None, sizes: Sequence[int]) -> None:
        """head: [R, F] features -> [R, V] logits (the final norm and LM head); features [M, F]: the
        pass's fed positions; index [B, 1+W]: the one at each row's position (padding: any), None
        where the M positions are [B, 1+W] as they are; sizes[b]: row b's fed positions."""
        self.head, self.features, self.sizes = head, features, list(sizes)
        self.index = index
        self.width = features.shape[0] // len(self.sizes) if index is None else index.shape[1]
        self.scored = [[False] * n for n in self.sizes]
        self.flat: torch.Tensor | None = None  # [M, V] from the first call of score()
        self._logits: torch.Tensor | None = None

    def score(self, wanted: dict[int, Sequence[int]]) -> None:
        """Score row b's positions wanted[b] (those not yet scored), every row's in one head call."""
        rows = [(b, j) for b, positions in wanted.items() for j in positions if not self.scored[b][j]]
        if not rows:
            return
        self._logits = None
        if self.flat is None and len(rows) == sum(self.sizes):  # all of them: nothing copied
            self.flat = self._head(self.features)               # (padded passes: the padding's too)
            self.scored = [[True] * n for n in self.sizes]
            return
        where = None if self.index is None else self.index.tolist()  # [B][1+W]
        at = torch.tensor([b * self.width + j if where is None else where[b][j] for b, j in rows],
                          device=self.features.device)
        logits = self._head(self.features[at])
        if self.flat is None:
            self.flat = logits.new_zeros(self.features.shape[0], logits.shape[-1])
        self.flat[at] = logits
        for b, j in rows:
            self.scored[b][j] = True

    def _head(self, features: torch.Tensor) -> torch.Tensor:
        """[R, F] -> [R, V], at most MAX_ROWS rows a call: past them a float head goes to torch's
        GEMM, whose bits depend on the row count."""
        if features.shape[0] <= MAX_ROWS:
            return self.head(features)
        return torch.cat([self.head(part) for part in features.split(MAX_ROWS)])

    @property
    def logits(self) -> torch.Tensor:
        """[B, 1+W, V]: the scored positions' logits, zeros at the others."""
        if self._logits is None:
            assert self.flat is not None, "score() comes first"
            self._logits = (self.flat.view(len(self.sizes), self.width, -1) if self.index is None
                            else self.flat[self.index])
        return self._logits

    def complete(self) -> torch.Tensor:
        """Every row's logits at all its fed positions [B, 1+W, V] (the target's top tokens need them)."""
        self.score({b: range(n) for b, n in enumerate(self.sizes)})
        return self.logits

    def unscored_on(self, b: int, kept: Sequence[int]) -> int | None:
        """The first node of row b's accepted path whose position was not scored (the walk read junk
        from there on), or None: the verdict stands."""
        return next((i for i in kept if not self.scored[b][1 + i]), None)


def subtree(draft: Draft, node: int) -> list[int]:
    """The positions of `node` and every node below it (parents precede children)."""
    inside = {node}
    for i, p in enumerate(draft.tree[node + 1:], start=node + 1):
        if p in inside:
            inside.add(i)
    return [1 + i for i in sorted(inside)]


def verify_scored(drafts: Sequence[Draft], scores: Scores, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], masks: Sequence[torch.Tensor | None],
                  generated: Sequence[Sequence[int] | None]) -> Verdict:
    """verify() over what `scores` holds; rows whose walk went past it scored further and verified
    again from their generators' states before (at most once: a node's subtree holds the rest of
    any walk through it)."""
    states = [None if p.greedy else g.get_state() for p, g in zip(params, generators)]
    verdict = verify(drafts, scores.logits, params, generators, masks, generated)
    again = {b: x for b, kept in enumerate(verdict.kept) if (x := scores.unscored_on(b, kept)) is not None}
    if not again:
        return verdict
    scores.score({b: subtree(drafts[b], x) for b, x in again.items()})
    rows = list(again)
    for b in rows:
        if states[b] is not None:
            generators[b].set_state(states[b])
    redone = verify([drafts[b] for b in rows], scores.logits[rows], [params[b] for b in rows],
                    [generators[b] for b in rows], [masks[b] for b in rows], [generated[b] for b in rows])
    kept, tokens = list(verdict.kept), list(verdict.tokens)
    for b, k, t in zip(rows, redone.kept, redone.tokens):
        assert scores.unscored_on(b, k) is None, "a node's subtree holds the rest of any walk through it"
        kept[b], tokens[b] = k, t
    return Verdict(kept, tokens)
