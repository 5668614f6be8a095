"""NgramProposer (prompt lookup): what it proposes, and that it stays pure Python.

Oracles: hand-worked sequences, and a brute-force scan of the whole sequence (longest suffix
first, most recent earlier occurrence, the tokens that followed it) compared on random sequences.
"""
from __future__ import annotations

import random
import sys

import pytest
import torch

from quickdraft.proposers import ngram as ngram_module
from quickdraft.proposers.base import Committed
from quickdraft.proposers.ngram import NgramProposer, merge


def committed(tokens: list[int], drafted: int) -> Committed:
    """What the engine tells a proposer after a step that appended `tokens`."""
    return Committed(tokens, drafted, drafted, torch.empty(len(tokens), 0))

def propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    draft = NgramProposer(tokens, max_n, min_n).propose(k)
    assert draft.q is None  # deterministic: q = one-hot(draft)
    return draft.tokens


def brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n:]
        for end in range(L - 2, n - 2, -1):  # occurrences ending before the last token, latest first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_docstring_example() -> None:
    assert propose([5, 9, 2, 7, 1, 5, 9, 2], k=3, max_n=3) == [7, 1, 5]


def test_most_recent_occurrence_wins() -> None:
    # [4] occurs at 0 (followed by 7) and at 2 (followed by 8): the later one is proposed.
    assert propose([4, 7, 4, 8, 9, 4], k=2, max_n=1) == [8, 9]
    assert propose([1, 2, 10, 1, 2, 20, 1, 2], k=1, max_n=2) == [20]


def test_longest_n_is_preferred() -> None:
    # Suffix [1 2 3] occurred at 0..2 (followed by 4 9); the 1-gram [3] occurred later, at 5
    # (followed by 5): the longer match wins over the more recent shorter one.
    tokens = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    assert propose(tokens, k=2, max_n=3) == [4, 9]
    assert propose(tokens, k=2, max_n=1) == [5, 1]
    # min_n above the only match length: nothing.
    assert propose([7, 8, 7], k=2, max_n=4, min_n=2) == []


@pytest.mark.parametrize("tokens", [[], [1], [1, 2, 3, 4], list(range(50))])
def test_no_match_proposes_nothing(tokens: list[int]) -> None:
    assert propose(tokens, k=4) == []


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_proposals_never_exceed_k(k: int) -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 3
    out = propose(tokens, k)
    assert len(out) == min(k, len(brute_force(tokens, 100, 4, 1)))
    assert out == brute_force(tokens, k, 4, 1)


def test_proposal_is_cut_by_the_end_of_the_sequence() -> None:
    # [6] last occurred at index 3, followed only by [6]: one token even with k = 5.
    assert propose([1, 2, 3, 6, 6], k=5, max_n=1) == [6]


def test_commit_extends_the_index() -> None:
    prop = NgramProposer([10, 11, 12], max_n=3)
    assert prop.propose(4).tokens == []
    prop.commit(committed([40, 41, 42, 11], 0))   # [11] now occurred before, at 1, followed by 12 40 41 42
    assert prop.propose(4).tokens == [12, 40, 41, 42]
    prop.commit(committed([50, 40, 41], 2))       # [40 41] occurred at 3..4, followed by 42 11 50
    assert prop.propose(3).tokens == [42, 11, 50]
    # A pattern made only of committed tokens is found: [50 40 41] ... [50]
    prop.commit(committed([60, 50], 1))
    assert prop.propose(3).tokens == [40, 41, 60]


@pytest.mark.parametrize("max_n, min_n", [(4, 1), (3, 2), (1, 1), (6, 3)])
def test_matches_brute_force_on_random_sequences(max_n: int, min_n: int) -> None:
    rng = random.Random(max_n * 10 + min_n)
    for _ in range(60):
        vocab = rng.choice([2, 3, 5, 8])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        prop = NgramProposer(prompt, max_n, min_n)
        seq = list(prompt)
        for _ in range(8):  # commits in uneven chunks, as the engine makes them
            k = rng.randrange(0, 7)
            assert prop.propose(k).tokens == brute_force(seq, k, max_n, min_n), (seq, k)
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
            prop.commit(committed(new, rng.randrange(0, len(new))))
            seq += new
        assert prop.tokens == seq


# -- no torch --------------------------------------------------------------------------------------------

def torch_calls(fn) -> list[str]:
    """Names of torch functions (Python or C) called while fn runs."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and "/torch/" in frame.f_code.co_filename.replace("\\", "/"):
            seen.append(frame.f_code.co_name)
        elif event == "c_call":
            module = getattr(arg, "__module__", None) or ""
            owner = getattr(arg, "__self__", None)
            if module.startswith("torch") or isinstance(owner, torch.Tensor) or \
                    getattr(owner, "__name__", "").startswith("torch"):
                seen.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_torch_call_detector_detects_torch() -> None:
    # Negative control for the check below: a function that does use torch is caught.
    assert torch_calls(lambda: torch.zeros(2).sum())


def test_a_miss_and_a_hit_cost_no_torch() -> None:
    prop = NgramProposer(list(range(200)), max_n=4)
    assert torch_calls(lambda: prop.propose(4)) == []               # a miss
    step = committed([5, 6, 7], 0)
    assert torch_calls(lambda: prop.commit(step)) == []             # index update
    assert torch_calls(lambda: prop.propose(4)) == []               # a hit ([5 6 7] seen before)
    assert prop.propose(4).tokens == [8, 9, 10, 11]
    assert "torch" not in vars(ngram_module)  # the module does not import torch itself


# -- ngram-tree: several earlier continuations merged into a trie ----------------------------------------

def test_merge_of_one_continuation_is_the_chain() -> None:
    draft = merge([(0.5, [4, 5, 6])], 8)
    assert (draft.tokens, draft.tree, draft.accept_probs, draft.is_chain) == ([4, 5, 6], [-1, 0, 1], [0.5] * 3, True)
    assert merge([(0.5, [4, 5, 6])], 2).tokens == [4, 5]
    assert merge([], 4).tokens == [] and merge([(0.5, [])], 4).tokens == []


def test_merge_shares_prefixes_and_grows_where_reaching_is_likeliest() -> None:
    # Two continuations share [1, 2] then part; a third starts elsewhere.
    draft = merge([(0.9, [1, 2, 3, 4]), (0.5, [1, 2, 7]), (0.5, [8, 9])], 6)
    nodes = list(zip(draft.tokens, draft.tree))
    assert sorted(nodes) == sorted([(1, -1), (2, 0), (3, 1), (4, 2), (8, -1), (7, 1)])
    assert all(p < i for i, p in enumerate(draft.tree))   # parents first: every prefix is a tree
    children_of_2 = [t for t, p in nodes if p == 1]
    assert children_of_2 == [3, 7]                       # the better continuation's child first
    estimates = dict(zip(draft.tokens, draft.accept_probs))
    assert estimates[3] == pytest.approx(0.9) and estimates[7] == pytest.approx(0.5 * 0.1)  # after 3 missed
    assert estimates[8] == pytest.approx(0.5 * 0.1)  # the root's second child: after 1 missed
    assert len(merge([(0.9, [1, 2, 3, 4]), (0.5, [1, 2, 7]), (0.5, [8, 9])], 3).tokens) == 3


def test_continuations_are_the_longest_matches_first_and_the_latest_first() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 3, 7, 2, 3]
    prop = NgramProposer(tokens, max_n=2, min_n=1, branches=4)
    found = prop.continuations(2)
    # [2 3] ended at 5 and 2 (latest first); then [3] alone ended at 8
    assert found == [((2, 0), [8, 5]), ((2, 1), [9, 2]), ((1, 2), [7, 2])]
    assert NgramProposer(tokens, 2, 1, branches=1).propose(2).tokens == [8, 5]
    tree = prop.propose(2)  # every rate 1/3 before any evidence: the root's first two children
    assert (tree.tokens, tree.tree) == ([8, 9], [-1, -1])
    assert tree.accept_probs == pytest.approx([1 / 3, 1 / 3 * 2 / 3])

