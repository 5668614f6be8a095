"""Draft trees: the verifier's walk, the inputs of a tree pass, the cache's compaction, and exactness
through the engine (greedy: plain decoding token for token, with the K/V of every row checked after
every step; sampling: the exact law of the first tokens, chi-square with a negative control).

Shapes: chain (parents i-1), star (every node a child of the root), deep (two long branches, the
right one second), bushy (two children per node, the right one second).
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Sequence

import pytest
import torch

import quickdraft.spec.verify as verify_module
from quickdraft.engine.batch import EngineConfig, Request
from quickdraft.engine.inputs import build_inputs
from quickdraft.engine.policy import RowDraft
from quickdraft.proposers.base import EACH, Committed, Draft
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams, probabilities
from quickdraft.spec.verify import sibling_ranks, verify
from support.engine import Job, first_tokens_in_batches, greedy, run_batched, target
from support.laws import (
    ALPHA,
    C0,
    JOINT,
    N_K1,
    N_SAMPLES,
    N_TOKENS,
    PM,
    PROMPT16,
    QM,
    T1,
    P,
    Q,
    assert_plain_sampling_law,
    chi_square_p_value,
    clear_logits,
    counts_of,
    log,
    plain_law,
)
from support.models import V16, tiny16

GREEDY = SamplingParams()
SHAPES = ["chain", "star", "deep", "bushy"]
VOCAB = 96  # the tiny target's


def tree_of(shape: str, right: Sequence[int], wrong: Sequence[int], k: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of at most k nodes: `right` along one path, `wrong` tokens elsewhere."""
    tokens, parents = [], []

    def add(token: int, parent: int) -> int:
        tokens.append(token)
        parents.append(parent)
        return len(tokens) - 1

    if shape == "chain":
        for i, t in enumerate(right[:k]):
            add(t, i - 1)
    elif shape == "star":
        for t in wrong[:k - 1]:
            add(t, -1)
        if right and k:
            add(right[0], -1)
    elif shape == "deep":  # a wrong branch first, then the right one
        half = k // 2
        for i, t in enumerate(wrong[:half]):
            add(t, i - 1)
        parent = -1
        for t in right[:k - len(tokens)]:
            parent = add(t, parent)
    else:  # bushy: under each right node, a wrong child then the right one
        parent = -1
        for t, w in zip(right, wrong):
            if len(tokens) + 2 > k:
                break
            add(w, parent)
            parent = add(t, parent)
    return tokens, parents


# -- the verifier's walk, greedy --------------------------------------------------------------------------

V = 10
TREE_CASES = {
    # name: (tokens, parents, argmax after the root and after each node, kept, emitted)
    "star, third child": ([4, 2, 7], [-1, -1, -1], [7, 0, 0, 5], [2], [7, 5]),
    "star, none": ([4, 2, 7], [-1, -1, -1], [9, 0, 0, 0], [], [9]),
    "duplicate siblings: the first": ([5, 5], [-1, -1], [5, 3, 8], [0], [5, 3]),
    "deep, second branch": ([1, 2, 3, 4, 5, 6], [-1, 0, 1, -1, 3, 4], [4, 0, 0, 0, 5, 6, 9], [3, 4, 5], [4, 5, 6, 9]),
    "deep, first branch cut": ([1, 2, 3, 4, 5, 6], [-1, 0, 1, -1, 3, 4], [1, 2, 8, 0, 0, 0, 0], [0, 1], [1, 2, 8]),
    "bushy": ([3, 4, 5, 6, 7, 8], [-1, -1, 1, 1, 3, 3], [4, 0, 6, 0, 8, 0, 2], [1, 3, 5], [4, 6, 8, 2]),
    "chain spelled out": ([1, 2, 3], [-1, 0, 1], [1, 2, 0, 0], [0, 1], [1, 2, 0]),
}


@pytest.mark.parametrize("name", TREE_CASES)
def test_greedy_walk_follows_the_argmax(name: str) -> None:
    tokens, parents, argmaxes, kept, emitted = TREE_CASES[name]
    logits = clear_logits(argmaxes)[None]  # [1, n+1, V]
    verdict = verify([Draft(tokens, parents=parents)], logits, [GREEDY], [torch.Generator()])
    assert (verdict.kept, verdict.tokens) == ([kept], [emitted])
    # A row's verdict does not depend on its neighbours (padding past its nodes included).
    other = TREE_CASES["bushy"]
    wide = torch.cat([logits, torch.zeros(1, 7 - logits.shape[1], V)], 1)
    both = verify([Draft(tokens, parents=parents), Draft(other[0], parents=other[1])],
                  torch.cat([wide, clear_logits(other[2])[None]]), [GREEDY] * 2, [torch.Generator()] * 2)
    assert (both.kept[0], both.tokens[0]) == (kept, emitted)


def test_sibling_ranks_group_nodes_without_shared_parents() -> None:
    assert sibling_ranks([-1, -1, 0, 0, 1, -1]) == [[0, 2, 4], [1, 3], [5]]
    assert sibling_ranks([-1, 0, 1]) == [[0, 1, 2]]  # a chain: one group


def test_policy_reads_a_tree_as_falling_chances() -> None:
    chain = RowDraft.of(Draft([1, 2], accept_probs=[0.5, 0.8]), False)
    assert chain.accept_probs == [0.5, 0.8]
    star = RowDraft.of(Draft([1, 2, 3], accept_probs=[0.5, 0.9, 0.2], parents=[-1, -1, 1]), False)
    # reach: 0.5, min(0.9, 0.5) = 0.5, min(0.9 * 0.2, 0.5) = 0.18; as chained factors:
    assert star.accept_probs == pytest.approx([0.5, 1.0, 0.36])


# -- the verifier's law, sampling -------------------------------------------------------------------------

def no_residual_update(draft: Draft, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased: each sibling is tested against its parent's p itself (no p <- normalize(max(0, p - q))
    after a rejected sibling); the final draw comes from the residual of the last sibling alone."""
    assert mask is None  # no grammar here
    n, parents = len(draft.tokens), draft.tree
    p = probabilities(logits, params)  # [n+1, V]
    x = torch.tensor(draft.tokens, dtype=torch.long)
    q = torch.zeros(n, p.shape[1]).scatter_(1, x[:, None], 1.0) if draft.q is None else draft.q.float()
    at = torch.tensor(parents, dtype=torch.long) + 1
    u = torch.rand(n, generator=generator)
    ok = u * q[torch.arange(n), x] < p[at, x]
    final = p.clone()
    for i in range(n):
        left = (p[at[i]] - q[i]).clamp(min=0)
        final[at[i]] = left if left.sum() > 0 else p[at[i]]
    return ok, torch.multinomial(final, 1, generator=generator)[:, 0]


def star_draws(n: int, siblings: int, q: torch.Tensor | None, seed: int) -> list[list[int]]:
    """n steps of a star: `siblings` children of the root drawn iid from q (or the distinct tokens
    0, 2, 3 when q is None, deterministic), target P at the root and P_BONUS-free bonus rows (P)."""
    g = torch.Generator().manual_seed(seed)
    drafts = []
    for _ in range(n):
        if q is None:
            drafts.append(Draft([0, 2, 3][:siblings], parents=[-1] * siblings))
        else:
            x = torch.multinomial(q, siblings, replacement=True, generator=g).tolist()
            drafts.append(Draft(x, q.expand(siblings, -1), parents=[-1] * siblings))
    logits = log(P).expand(n, siblings + 1, -1)
    return verify(drafts, logits, [T1] * n, [g] * n).tokens


@pytest.mark.parametrize("siblings, q", [(3, Q), (2, torch.full((6,), 1 / 6)), (3, None)],
                         ids=["3-iid-from-q", "2-iid-uniform", "3-deterministic"])
def test_siblings_first_token_follows_p(siblings: int, q: torch.Tensor | None) -> None:
    first = counts_of([t[0] for t in star_draws(N_K1, siblings, q, seed=5)], 6)
    assert first[5] == 0 and first[4] > 0  # p = 0 never emitted; p > 0 = q reached by recovery
    assert chi_square_p_value(first, P) > ALPHA


@pytest.mark.parametrize("siblings, q", [(3, Q), (3, None)], ids=["3-iid-from-q", "3-deterministic"])
def test_siblings_negative_control_is_rejected(siblings: int, q: torch.Tensor | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the residual update between siblings a token gets several chances: the law shifts
    toward the drafted tokens, far past what ALPHA allows at N_K1 draws."""
    monkeypatch.setattr(verify_module, "_sampled_tests", no_residual_update)
    first = counts_of([t[0] for t in star_draws(N_K1, siblings, q, seed=5)], 6)
    assert chi_square_p_value(first, P) < ALPHA


def markov_tree(last: int, g: torch.Generator) -> tuple[Draft, torch.Tensor]:
    """A two-level tree after context token `last`: two children iid from QM[last], each with one
    child from QM[child]; logits log PM[token] at the root and at each node."""
    a, b = torch.multinomial(QM[last], 2, replacement=True, generator=g).tolist()
    c = int(torch.multinomial(QM[a], 1, generator=g))
    d = int(torch.multinomial(QM[b], 1, generator=g))
    tokens, parents = [a, b, c, d], [-1, -1, 0, 1]
    draft = Draft(tokens, torch.stack([QM[last], QM[last], QM[a], QM[b]]), parents=parents)
    return draft, log(torch.stack([PM[last], *(PM[t] for t in tokens)]))


def test_two_level_tree_joint_of_first_two_tokens_follows_p() -> None:
    g, n = torch.Generator().manual_seed(6), 20_000
    drafts, logits = zip(*(markov_tree(C0, g) for _ in range(n)))
    tokens = verify(list(drafts), torch.stack(logits), [T1] * n, [g] * n).tokens
    pairs = [t[:2] for t in tokens if len(t) >= 2]
    for t in (t for t in tokens if len(t) == 1):  # a second step after a lone first token
        draft, logit = markov_tree(t[0], g)
        pairs.append([t[0], verify([draft], logit[None], [T1], [g]).tokens[0][0]])
    pairs_t = torch.tensor(pairs)
    counts = torch.bincount(pairs_t[:, 0] * 5 + pairs_t[:, 1], minlength=25).view(5, 5)
    assert (counts[JOINT == 0] == 0).all()
    assert chi_square_p_value(counts, JOINT) > ALPHA
    accepted = sum(len(t) - 1 for t in tokens)
    assert 0 < accepted < 2 * n  # the premise: trees were partly accepted


# -- a tree pass's inputs and the cache --------------------------------------------------------------------

def test_inputs_of_a_tree_row_beside_a_chain_row() -> None:
    tree = Draft([11, 12, 13], parents=[-1, -1, 1])  # root -> 11, root -> 12 -> 13
    chain = Draft([21])
    inputs = build_inputs([5, 3], [10, 20], [tree, chain], torch.device("cpu"))
    assert inputs.ids.tolist() == [[10, 11, 12, 13], [20, 21, 20, 20]]
    assert inputs.positions.tolist() == [[5, 6, 6, 7], [3, 4, 5, 6]]   # depth-based
    assert inputs.slots.tolist() == [[5, 6, 7, 8], [3, 4, 5, 6]]       # one slot per node
    mask = inputs.mask.int()
    assert mask.shape == (2, 4, 9)
    assert mask[0, :, :5].all()  # the committed slots
    assert mask[0, :, 5:].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert mask[1, :2, :5].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # chain: causal over its slots
    assert not mask[1, :, 7:].any()
    only_chains = build_inputs([5, 3], [10, 20], [chain, Draft([1, 2])], torch.device("cpu"))
    assert only_chains.mask is None and only_chains.slots is None
    assert only_chains.positions.tolist() == [[5, 6, 7], [3, 4, 5]]


def test_compact_moves_the_kept_path_into_place() -> None:
    model = target()
    cache = model.new_cache(2, 40)  # rows of 3 blocks: the path crosses from one block into the next
    c = model.config
    for row in (0, 1):
        n = c.num_layers * 2 * c.num_kv_heads * 40 * c.head_dim
        cache.write_rows(row, 0, torch.arange(row * n, (row + 1) * n, dtype=torch.float32).view(
            c.num_layers, 2, c.num_kv_heads, 40, c.head_dim))
    before = [cache.read(row, 0, 40) for row in (0, 1)]
    cache.compact(1, 14, [15, 17, 18, 33])
    after = cache.read(1, 0, 40)
    assert torch.equal(after[..., 14:18, :], before[1][..., [15, 17, 18, 33], :])
    assert torch.equal(cache.read(0, 0, 40), before[0]) and torch.equal(after[..., :14, :], before[1][..., :14, :])
    cache.compact(0, 4, [4, 5])  # a chain's path is in place: nothing moves
    assert torch.equal(cache.read(0, 0, 40), before[0])


# -- exactness through the engine -----------------------------------------------------------------------

class TreeOracle:
    """Drafts trees of one shape that hold the plain greedy continuation along one path (cut at a
    random depth, so acceptance is mixed) and wrong tokens elsewhere."""
    group = EACH

    def __init__(self, shape: str, continuation: Sequence[int], seed: int) -> None:
        self.shape, self.future, self.done = shape, list(continuation), 0
        self.rng = random.Random(seed)

    def propose(self, k: int) -> Draft:
        right = self.future[self.done:self.done + self.rng.randrange(0, k + 1)]
        right += [self.rng.randrange(VOCAB) for _ in range(k)]  # past the cut: likely wrong
        wrong = [self.rng.randrange(VOCAB) for _ in range(k)]
        tokens, parents = tree_of(self.shape, right, wrong, k)
        return Draft(tokens, parents=parents)

    def commit(self, step: Committed) -> None:
        self.done += len(step.tokens)


def tree_jobs(model, shape: str) -> list[Job]:
    base = [Job([1, 17, 42, 8, 77, 23], greedy(30), None, 0),
            Job([5, 6, 7, 8, 9, 10, 5, 6], greedy(25), None, 6, join_at=1),
            Job([3, 3, 4, 5], greedy(12), None, 4, join_at=2),
            Job([9, 2, 9, 2], greedy(20, stop_token_ids=(29,)), None, 8, join_at=3)]
    jobs = []
    for i, job in enumerate(base):
        plain = job.alone(model)
        make = None if job.k == 0 else (lambda prompt, params, plain=plain, i=i: TreeOracle(shape, plain, i))
        jobs.append(replace(job, make=make))
    return jobs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_trees_equal_plain_decoding(shape: str, max_batch: int) -> None:
    model = target()
    jobs = tree_jobs(model, shape)
    plain = [replace(job, make=None, k=0).alone(model) for job in jobs]
    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=max_batch, policy="fixed"))
    assert violations == []  # every row's length and K/V equal plain decoding's after every step
    assert [out[str(i)] for i in range(len(jobs))] == plain
    stats = [last[str(i)].stats for i in range(1, len(jobs))]
    assert all(0 < s.accepted_tokens < s.drafted_tokens for s in stats)  # the premise: mixed acceptance
    if shape != "chain":
        assert any(s.tokens_per_pass > 1 for s in stats)


class RandomTree:
    """Sampled trees over V16: a star of two children iid from a fixed q, each with one child from q."""
    group = EACH

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(V16, generator=self.generator), -1)

    def propose(self, k: int) -> Draft:
        n = min(k, 4)
        x = torch.multinomial(self.q, n, replacement=True, generator=self.generator).tolist()
        return Draft(x, self.q.expand(n, -1), parents=[-1, -1, 0, 1][:n])

    def commit(self, step: Committed) -> None:
        pass


def sampled_tree_counts() -> tuple[torch.Tensor, int, int]:
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=N_TOKENS + 1, ignore_eos=True)
              for seed in range(40_000, 40_000 + N_SAMPLES)]
    return first_tokens_in_batches(tiny16(), [Request(PROMPT16, p, frozenset(), RandomTree(p.seed), 4, adaptive=False,
                                                      id=str(p.seed)) for p in params])


def test_sampled_trees_through_the_engine_follow_plain_sampling() -> None:
    counts, drafted, accepted = sampled_tree_counts()
    assert int(counts.sum()) == N_SAMPLES
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)
    # negative control: the same draws against plain sampling at another temperature must fail
    other = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=0.75), N_TOKENS)
    assert chi_square_p_value(counts, other) < ALPHA


# -- ngram-tree ------------------------------------------------------------------------------------------

class Shapes:
    """Wraps a proposer and counts the trees (drafts that are not chains) it offers."""
    group = EACH

    def __init__(self, inner: NgramProposer) -> None:
        self.inner, self.trees = inner, 0

    def propose(self, k: int) -> Draft:
        draft = self.inner.propose(k)
        self.trees += not draft.is_chain
        return draft

    def commit(self, step: Committed) -> None:
        self.inner.commit(step)


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_ngram_trees_equal_plain_decoding(policy: str, max_batch: int) -> None:
    model = target()
    wrappers: list[Shapes] = []

    def make(prompt: Sequence[int], params: SamplingParams) -> Shapes:
        wrappers.append(Shapes(NgramProposer(prompt, 4, 1, branches=4)))
        return wrappers[-1]

    jobs = [replace(job, make=make if job.k else None) for job in tree_jobs(model, "chain")]
    plain = [replace(job, make=None, k=0).alone(model) for job in jobs]
    out, last, violations = run_batched(model, jobs, EngineConfig(max_batch=max_batch, policy=policy))
    assert violations == []
    assert [out[str(i)] for i in range(len(jobs))] == plain
    assert sum(w.trees for w in wrappers) > 0  # the premise: trees were offered
    if policy == "fixed":
        assert sum(last[str(i)].stats.accepted_tokens for i in range(len(jobs))) > 0


def test_sampled_ngram_trees_through_the_engine_follow_plain_sampling() -> None:
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=N_TOKENS + 1, ignore_eos=True)
              for seed in range(50_000, 50_000 + N_SAMPLES)]
    counts, drafted, accepted = first_tokens_in_batches(tiny16(), [
        Request(PROMPT16, p, frozenset(), NgramProposer(PROMPT16, 4, 1, branches=4), 4, adaptive=False,
                id=str(p.seed)) for p in params])
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)
