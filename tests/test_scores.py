"""Verification that stops scoring at the first rejection (engine/scores.py, policy.first_scored).

Oracle: verify() over logits the head computed at every position. Scoring only the first m
positions of each row (every m), then the rest of a walk's subtree where the walk goes past them,
must give bitwise the same verdict and leave every generator in the same state, for greedy and
sampled rows, chains and trees, with grammar masks and penalties; the head must have scored fewer
positions where a walk ended early (else the saving is not there).
"""
from __future__ import annotations

import random

import pytest
import torch

from quickdraft.engine.policy import StepCost, first_scored
from quickdraft.engine.scores import Scores, subtree, verify_scored
from quickdraft.spec.draft_contract import Draft
from quickdraft.spec.sampling import SamplingParams
from quickdraft.spec.verify import verify

V, F = 12, 8
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
          SamplingParams(temperature=1.3, top_p=0.9, presence_penalty=0.5, seed=2),
          SamplingParams(temperature=3.0, top_p=0.5, seed=3)]  # (a wide vocabulary: positions left out
                                                                # are flat, their top 256 under top_p)


def integers(*shape: int, seed: int) -> torch.Tensor:
    """Small integers as floats: their products and sums are exact, so a head over them gives each
    row the same bits whatever rows share the call, as the engine's kernels do."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


class CountingHead:
    """A fixed linear head [F] -> [V] that counts the positions it scores."""

    def __init__(self, seed: int, vocab: int = V) -> None:
        self.weight = integers(vocab, F, seed=seed)
        self.rows = self.calls = 0

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        self.rows += features.reshape(-1, F).shape[0]
        self.calls += 1
        return features @ self.weight.T


def a_draft(rng: random.Random, head: CountingHead, root: torch.Tensor, n: int, tree: bool,
            features: torch.Tensor) -> Draft:
    """A draft of n nodes whose tokens are mostly the head's argmax at their parent's position
    (features [1+n, F], position 0 the root): walks go deep, and sometimes stop."""
    parents = [(rng.randrange(-1, i) if tree and i else i - 1) for i in range(n)]
    logits = features @ head.weight.T
    tokens = [int(logits[p + 1].argmax()) if rng.random() < 0.75 else rng.randrange(logits.shape[-1])
              for p in parents]
    return Draft(tokens, None, [0.7] * n, parents if tree else None)


def scores_of(head: CountingHead, features: torch.Tensor, sizes: list[int], ragged: bool) -> Scores:
    """Scores over features [B, 1+W, F] as a padded pass gives them, or as a ragged pass does (each
    row's fed positions only, one after another, and where each row's position is)."""
    if not ragged:
        return Scores(head, features.flatten(0, 1), None, sizes)
    flat = torch.cat([features[b, :n] for b, n in enumerate(sizes)])
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    index = torch.tensor([[start + (j if j < n else 0) for j in range(features.shape[1])]
                          for start, n in zip(starts, sizes)])
    return Scores(head, flat, index, sizes)


def generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("vocab", [V, 600])
@pytest.mark.parametrize("tree", [False, True])
def test_scoring_a_prefix_first_gives_bitwise_the_full_verdict(tree: bool, vocab: int) -> None:
    rng = random.Random(0)
    checked = saved = redone = 0
    for trial in range(60):
        head = CountingHead(trial, vocab)
        B = 3
        sizes = [rng.randrange(0, 7) for _ in range(B)]
        W = max(sizes)
        features = integers(B, W + 1, F, seed=trial)
        drafts = [a_draft(rng, head, features[b, 0], n, tree, features[b]) for b, n in enumerate(sizes)]
        params = [PARAMS[(trial + b) % len(PARAMS)] for b in range(B)]
        masks = [None if rng.random() < 0.5 else torch.rand(1 + n, vocab, generator=torch.Generator().manual_seed(b))
                 > 0.2 for b, n in enumerate(sizes)]
        for mask in masks:
            if mask is not None:
                mask[:, 0] = True  # every position allows a token
        generated = [[1, 2, 2], None, [3]]
        seeds = [rng.randrange(1 << 30) for _ in range(B)]
        full_gens = generators(seeds)
        expected = verify(drafts, head(features), params, full_gens, masks, generated)
        for m in range(1, W + 2):
            head.rows = head.calls = 0
            scores = scores_of(head, features, [1 + n for n in sizes], ragged=bool(m % 2))
            scores.score({b: range(min(m, 1 + n)) for b, n in enumerate(sizes)})
            lazy_gens = generators(seeds)
            got = verify_scored(drafts, scores, params, lazy_gens, masks, generated)
            assert got == expected, f"trial {trial}, first {m} positions"
            for a, e in zip(lazy_gens, full_gens):  # the next draws are the same too
                assert torch.equal(a.get_state(), e.get_state())
            for b, kept in enumerate(got.kept):  # every position the walk stood on was scored
                assert all(scores.scored[b][j] for j in [0, *(1 + i for i in kept)])
            checked += 1
            saved += head.rows < sum(1 + n for n in sizes)
            redone += head.calls > 1
    # the premises: many walks stopped before the positions ran out, many went past the first ones
    assert checked > 200 and saved > 50 and redone > 50, (checked, saved, redone)


def test_a_walk_past_the_scored_positions_scores_its_node_subtree_only() -> None:
    draft = Draft([1, 2, 3, 4, 5], None, None, [-1, -1, 0, 1, 2])  # 0 -> 2 -> 4 and 1 -> 3
    assert subtree(draft, 0) == [1, 3, 5] and subtree(draft, 1) == [2, 4] and subtree(draft, 4) == [5]
    chain = Draft([1, 2, 3])
    assert subtree(chain, 1) == [2, 3]


def test_top_tokens_see_every_position_once_asked() -> None:
    head = CountingHead(0)
    features = integers(2, 4, F, seed=1)
    scores = scores_of(head, features, [4, 2], ragged=True)
    scores.score({0: [0], 1: [0]})
    assert head.rows == 2
    logits = scores.complete()
    assert head.rows == 6  # the four left out of the valid positions, padding never
    assert torch.equal(logits[0], features[0] @ head.weight.T) and torch.equal(logits[1, :2], features[1, :2] @ head.weight.T)


def test_unpadded_rows_scored_whole_take_one_head_call_and_no_copy() -> None:
    head = CountingHead(0)  # (the engine's case wherever the policy expects every position read)
    features = integers(2, 3, F, seed=2)
    scores = Scores(head, features.flatten(0, 1), None, [3, 3])
    scores.score({0: range(3), 1: range(3)})
    assert head.rows == 6 and torch.equal(scores.logits, features @ head.weight.T)


def test_first_scored_weighs_a_second_head_call_against_the_positions_it_saves() -> None:
    prior = StepCost().head_cost  # n + 6
    assert first_scored([], prior) == 1                 # no draft: the root
    assert first_scored([1.0] * 8, prior) == 9          # every node accepted: all in one call
    assert first_scored([0.0] * 8, prior) == 1          # none accepted: the root alone decides
    # 0.6 per node along a chain: the second call pays once reach falls low enough
    reach = [0.6 ** (i + 1) for i in range(8)]
    m = first_scored(reach, prior)
    assert 1 < m < 9
    cost = {k: prior(k) + (reach[k - 1] * prior(9 - k) if k <= 8 else 0.0) for k in range(1, 10)}
    assert cost[m] == min(cost.values())
    flat = StepCost()  # a head that costs the same for any count (memory-bound): never split
    flat.seed({1: 1.0, 9: 2.0}, {1: 0.2, 9: 0.2})
    assert first_scored(reach, flat.head_cost) == 9


def test_a_measured_head_curve_never_falls_and_is_read_between_its_points() -> None:
    cost = StepCost()
    cost.seed({1: 1.0, 4: 1.5}, {1: 0.2, 2: 0.19, 4: 0.4})
    assert cost.head == {1: 0.2, 2: 0.2, 4: 0.4}
    assert cost.head_cost(3) == pytest.approx(0.3) and cost.head_cost(6) == pytest.approx(0.6)
