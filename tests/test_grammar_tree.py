"""The masked sampling law through a draft tree: prompt lookup's trees (ngram-tree) under a grammar
whose allowed tokens at a node depend on the node's own path, so each branch must be masked along
its path (test_grammar.py has the chain version, with a draft model).

Oracle: the masked target's law of the first three tokens, computed by hand from the target's
exact joint law (chi-square, false failure ALPHA = 1e-6, seeded: deterministic), and a negative
control the same draws must fail: the law a verifier would sample that masks every drafted node
with the mask below the tree's root instead of its own path's. Premises counted: trees offered
whose branches both go on past the first level (the per-path masks ran), drafts accepted and
rejected, nodes cut. A tiny random model and a 16-letter vocabulary, made in the test.
"""
from __future__ import annotations

import functools

import llguidance
import torch

from quickdraft.engine.batch import Request
from quickdraft.proposers.base import Draft
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import Constraint
from support.engine import first_tokens_in_batches
from support.grammar import LETTERS, letters
from support.laws import ALPHA, chi_square_p_value, plain_law
from support.models import V16, tiny16

# a-f, then a pair whose second letter's set depends on the first: a-c then d-f, or d-f then a-c
GRAMMAR = "start: /[a-f]([a-c][d-f]|[d-f][a-c])/"
FIRST, LOW, HIGH = range(6), range(3), range(3, 6)
# each of a-f followed by two others in the prompt, then a third: prompt lookup offers a tree of
# branches below the first letter, each going on, some of their nodes forbidden by their path
PROMPT = [LETTERS.index(c) for c in "abdaebbafbcecadcfbdbedeaecfedbfaefbc"]
N_REQUESTS = 1200
K, BRANCHES = 6, 3
T1 = SamplingParams(temperature=1.0)


class Watched(Constraint):
    """Counts the shaped drafts in which two branches each go on below the first level, and the
    offered nodes the grammar cut."""
    branching = cut = 0

    def shape(self, offered: Draft, limit: int) -> Draft:
        draft = super().shape(offered, limit)
        parents = {parent for parent, depth in zip(draft.tree, draft.depths()) if depth >= 2}
        Watched.branching += len(parents) >= 2
        Watched.cut += len(offered.tokens) - len(draft.tokens)
        return draft


def allowed(tokens: range) -> torch.Tensor:
    mask = torch.zeros(V16, dtype=torch.double)
    mask[list(tokens)] = 1.0
    return mask


def masked_law(third: torch.Tensor) -> torch.Tensor:
    """[V16]*3: the target's law of the first three tokens, each step renormalized over its allowed
    letters; third[x2] is the mask of the third letter after x2."""
    law = plain_law(tiny16(), PROMPT, T1, 3)  # the target's exact joint law, unmasked

    def renormalized(p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p = p * mask
        return torch.nan_to_num(p / p.sum(-1, keepdim=True))

    first = renormalized(law.sum((1, 2)), allowed(FIRST))
    second = renormalized(law.sum(2) / law.sum((1, 2))[:, None], allowed(FIRST))
    last = renormalized(law / law.sum(2, keepdim=True), third[None])
    return first[:, None, None] * second[:, :, None] * last


def path_masks() -> torch.Tensor:
    """[V16, V16]: the third letter's mask after each second letter, as the grammar says."""
    third = torch.zeros(V16, V16, dtype=torch.double)
    third[list(LOW)] = allowed(HIGH)
    third[list(HIGH)] = allowed(LOW)
    return third


@functools.lru_cache(maxsize=None)
def tree_counts() -> tuple[torch.Tensor, int, int, int, int]:
    """Counts [V16]*3 of N_REQUESTS seeded requests, 8 rows at a time, each drafting prompt lookup's
    trees of up to K nodes, BRANCHES continuations, under GRAMMAR; the drafted and accepted tokens,
    the drafts with branches that go on, the nodes cut."""
    Watched.branching = Watched.cut = 0
    grammar = llguidance.LLMatcher.grammar_from_lark(GRAMMAR)
    requests = []
    for seed in range(N_REQUESTS):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=10)  # room for trees of K
        constraint = Watched(llguidance.LLMatcher(letters().tokenizer, grammar, log_level=0), letters())
        requests.append(Request(PROMPT, params, frozenset({15}), NgramProposer(PROMPT, 4, 1, branches=BRANCHES), K,
                                constraint=constraint, id=str(seed)))
    counts, drafted, accepted = first_tokens_in_batches(tiny16(), requests, 3)
    return counts, drafted, accepted, Watched.branching, Watched.cut


def test_draft_trees_under_a_grammar_sample_the_masked_target() -> None:
    """Sampled speculation with draft trees, each node masked along its own path, drafts cut at
    forbidden tokens: the first three tokens follow the masked target's law."""
    counts, drafted, accepted, branching, cut = tree_counts()
    assert branching > 100 and cut > 0  # the premises: branches that each go on (per-path masks), cuts
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts verified, some rejected
    law = masked_law(path_masks())
    assert counts.sum() == N_REQUESTS and counts[law == 0].sum() == 0  # every answer in the grammar
    assert chi_square_p_value(counts, law) > ALPHA


def test_negative_control_nodes_masked_by_the_roots_mask_are_rejected() -> None:
    """The same draws against the law of a verifier that masks every drafted node with the mask
    below the tree's root (any of a-f as the third letter) must fail."""
    counts, _, _, _, _ = tree_counts()
    wrong = masked_law(allowed(FIRST).expand(V16, V16))
    assert chi_square_p_value(counts, wrong) < ALPHA
