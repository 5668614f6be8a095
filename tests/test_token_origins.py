"""Per-token origins, as the engine labels them: table-driven over draft trees, then through the
engine with a draft equal to the target (every draft accepted whole), a random one (labels
against the statistics) and a tree whose second branch is right (branch, accepted, bonus).
Their way out to clients: tests/test_stream_origins.py.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import quickdraft
from quickdraft.engine.events import TokenOrigin, token_origins
from quickdraft.engine.loop import generate_tokens
from quickdraft.proposers import EACH, NO_DRAFT, Committed, Draft, SpecConfig
from quickdraft.spec.sampling import SamplingParams
from tiny_tokenizer import tiny_llm_dir

At = TokenOrigin  # (kind, depth)

#   parents (the verified draft tree), kept (the accepted path), origins
CASES = {
    "no draft": ([], [], [At("target", 0)]),
    "chain, all accepted": ([-1, 0, 1], [0, 1, 2],
                            [At("accepted", 1), At("accepted", 2), At("accepted", 3), At("bonus", 4)]),
    "chain, mismatch at 0": ([-1, 0, 1], [], [At("recovered", 1)]),
    "chain, mismatch at 2": ([-1, 0, 1], [0, 1], [At("accepted", 1), At("accepted", 2), At("recovered", 3)]),
    # root -> 0 -> 2, root -> 1 (a second candidate for the first token) -> 3
    "tree, second sibling's branch to its leaf": ([-1, -1, 0, 1], [1, 3],
                                                  [At("branch", 1), At("accepted", 2), At("bonus", 3)]),
    "tree, a short branch's leaf": ([-1, -1, 0, 2], [1], [At("branch", 1), At("bonus", 2)]),
    "tree, rejected below a kept node": ([-1, -1, 0, 2], [0], [At("accepted", 1), At("recovered", 2)]),
    "tree, every first candidate rejected": ([-1, -1, 0], [], [At("recovered", 1)]),
}


@pytest.mark.parametrize("case", CASES)
def test_token_origins_table(case: str) -> None:
    parents, kept, expected = CASES[case]
    assert token_origins(parents, kept) == expected


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("origins")
    return tiny_llm_dir(root / "target", max_position_embeddings=512), tiny_llm_dir(root / "draft", seed=3)


def events(target: Path, draft: Path, n: int) -> list:
    """Greedy events of the target with the draft model, whole drafts of 4 verified every pass."""
    llm = quickdraft.load(str(target))
    spec = SpecConfig("draft", k=4, adaptive=False, draft_model=str(draft))
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("once upon a time")
    proposer = llm.proposer(ids, params, spec)
    return list(generate_tokens(llm.model, ids, params, frozenset(), proposer, spec.k, adaptive=False))


def test_engine_labels_every_token_a_draft_equal_to_the_target_is_accepted_whole(dirs) -> None:
    steps = events(dirs[0], dirs[0], 21)  # 1 after the prompt, then 4 passes of 4 accepted + 1 bonus
    assert steps[0].origins == [At("target", 0)]
    whole = [At("accepted", 1), At("accepted", 2), At("accepted", 3), At("accepted", 4), At("bonus", 5)]
    assert [e.origins for e in steps[1:]] == [whole] * 4
    assert all(len(e.origins) == len(e.token_ids) for e in steps)


def test_engine_labels_match_the_statistics_with_a_random_draft(dirs) -> None:
    steps = events(dirs[0], dirs[1], 40)
    kinds = Counter(o.kind for e in steps for o in e.origins)
    assert sum(kinds.values()) == steps[-1].stats.new_tokens == 40 and kinds["recovered"] > 0
    accepted_before = drafted_before = 0
    for e in steps[:-1]:  # the last may be cut by the budget
        accepted, drafted = e.stats.accepted_tokens - accepted_before, e.stats.drafted_tokens - drafted_before
        accepted_before, drafted_before = e.stats.accepted_tokens, e.stats.drafted_tokens
        last = "target" if drafted == 0 else "bonus" if accepted == drafted else "recovered"
        drafts = [At("accepted", d) for d in range(1, accepted + 1)]
        assert e.origins == drafts + [At(last, accepted + 1 if drafted else 0)]


class SecondGuessRight:
    """Offers a tree over the next two tokens of plain greedy decoding: a wrong first candidate, then
    the right one with the right next token under it (greedy must take the second branch to its leaf)."""
    group = EACH

    def __init__(self, continuation: list[int], vocab_size: int) -> None:
        self.continuation, self.vocab_size, self.n = continuation, vocab_size, 0

    def commit(self, step: Committed) -> None:
        self.n += len(step.tokens)

    def propose(self, k: int) -> Draft:
        if k < 3 or self.n + 2 > len(self.continuation):
            return NO_DRAFT
        right, after = self.continuation[self.n], self.continuation[self.n + 1]
        return Draft([(right + 1) % self.vocab_size, right, after], parents=[-1, -1, 1])


def test_engine_labels_a_tree_branch_taken_to_its_leaf(dirs) -> None:
    llm = quickdraft.load(str(dirs[0]))
    params = SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True)  # 1 + 4 x 3 + 1
    ids = llm.tokenizer.encode("once upon a time")
    plain = [t for e in generate_tokens(llm.model, ids, params) for t in e.token_ids]
    proposer = SecondGuessRight(plain, llm.model.config.vocab_size)
    steps = list(generate_tokens(llm.model, ids, params, frozenset(), proposer, 3, adaptive=False))
    assert [t for e in steps for t in e.token_ids] == plain
    assert steps[0].origins == [At("target", 0)]
    tree = [At("branch", 1), At("accepted", 2), At("bonus", 3)]
    assert [e.origins for e in steps[1:]] == [tree] * 4 + [[At("target", 0)]]  # the last: no room for a draft
