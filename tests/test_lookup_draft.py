"""Prompt lookup first, then a draft model (`lookup-draft`), and `auto`'s measured choice.

Oracles: plain greedy decoding through the same engine (token for token); the draft model's cache
recomputed from scratch after every commit (support.engine.Checked), which fails if the
hybrid tells it a wrong count of its own drafts; the exact law of the first sampled tokens.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from quickdraft.engine.loop import generate_tokens
from quickdraft.model.llama import Transformer
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.proposers import Committed, Draft, SpecConfig, SpecConfigError
from quickdraft.proposers.base import EACH, ProposerContext
from quickdraft.proposers.datastore import Datastore
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.hybrid import (
    AUTO_MEASURED,
    HybridProposer,
    Measured,
    make_auto,
)
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.proposers.registry import PROPOSERS
from quickdraft.spec.goodput import Acceptance
from quickdraft.spec.sampling import SamplingParams
from quickdraft.spec.sequences import common_prefix
from quickdraft.weights.tokenizers import load_hf_tokenizer
from support.engine import Checked, greedy
from support.laws import (
    ALPHA,
    N_SAMPLES,
    N_TOKENS,
    PROMPT16,
    SAMPLE_K,
    SAMPLE_NEW,
    assert_plain_sampling_law,
    chi_square_p_value,
    plain_law,
)
from support.models import K_QUANT_SHAPE, V16, tiny, tiny16, tiny16_draft
from tiny_models import hf_model, ours_from_hf
from tiny_tokenizer import save_tokenizer

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]  # repeats: the lookup finds matches
MAX_NEW = 40


def lookup_draft(draft: Transformer, prompt: Sequence[int], params: SamplingParams, k: int,
                 drafter: Drafter | None = None) -> tuple[HybridProposer, Checked]:
    capacity = len(prompt) + params.max_new_tokens + k + 1  # as make_draft sizes it
    checked = Checked(DraftModelProposer(drafter or Drafter(draft), prompt, params, capacity), prompt)
    return HybridProposer(NgramProposer(prompt, 4, 1), checked, "draft"), checked


def run(model: Transformer, proposer, k: int, params: SamplingParams, prompt: Sequence[int] = PROMPT):
    ids, origins, stats = [], [], None
    for event in generate_tokens(model, prompt, params, frozenset(), proposer, k, adaptive=False):
        ids += event.token_ids
        origins += event.origins
        stats = event.stats
    return ids, origins, stats


def noisy(name: str, noise: float, device: str = "cpu") -> Transformer:
    """The target tiny(name, init=0.1) with Gaussian noise on its weights: a draft that is right
    part of the time."""
    base, _, qtype = name.partition("@")
    hf = hf_model(base, seed=0, initializer_range=0.1, **(K_QUANT_SHAPE if qtype.endswith("_K") else {}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=g) * noise * param.std())
    model = ours_from_hf(hf, qtype=GGMLQuantizationType[qtype] if qtype else None)
    return model if device == "cpu" else model.to(device)


class Counting(HybridProposer):
    """Counts the steps whose lookup draft was chosen though the draft model had drafted tokens
    that the step committed (their K/V stay in its cache)."""
    kept_unchosen = 0

    def commit(self, step: Committed) -> None:
        if self.chosen == "ngram" and common_prefix(self.offered.get("draft", []), step.tokens[:-1]):
            self.kept_unchosen += 1
        super().commit(step)


DRAFTS = {  # scenario: model name -> the draft (same weights: all accepted; other: mostly rejected)
    "draft-same": lambda m: tiny(m, init=0.1),
    "draft-random": lambda m: tiny(m, seed=1, init=0.1),
    "draft-noisy": lambda m: noisy(m, 0.6 if "_K" in m else 0.3),  # both parts' drafts accepted
}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("scenario", DRAFTS)
@pytest.mark.parametrize("model_name", ["llama-gqa-untied", "qwen2-qkv-bias", "llama-gqa-untied@Q4_K"])
def test_lookup_then_draft_model_equals_plain_greedy(model_name: str, scenario: str, k: int) -> None:
    target = tiny(model_name, init=0.1)
    plain, _, _ = run(target, None, 0, greedy(MAX_NEW))
    checked = Checked(DraftModelProposer(Drafter(DRAFTS[scenario](model_name)), PROMPT, greedy(MAX_NEW),
                                         len(PROMPT) + MAX_NEW + k + 1), PROMPT)
    hybrid = Counting(NgramProposer(PROMPT, 4, 1), checked, "draft")
    ids, origins, stats = run(target, hybrid, k, greedy(MAX_NEW))
    assert ids == plain
    assert checked.violations == []  # the draft's cache holds K/V of committed tokens only, as computed fresh
    by_source = Counter(o.source for o in origins if o.kind in ("accepted", "branch"))
    assert stats.drafted_tokens > 0 and None not in by_source
    # the premises: which part's drafts were accepted (a perfect draft wins most steps once its
    # calibration has learned it is right: lookup may take the first ones)
    if scenario == "draft-same":
        assert by_source["draft"] > 2 * by_source["ngram"]
    else:
        assert set(by_source) == {"draft-random": {"ngram"},
                                  "draft-noisy": {"ngram", "draft"} if k > 1 else set(by_source)}[scenario]


def test_an_unchosen_draft_keeps_the_kv_of_its_committed_tokens() -> None:
    """Steps where the lookup's draft is chosen, and the draft model's drafts agree with what
    was committed: their K/V stay (checked against a fresh forward after every commit)."""
    target = tiny("qwen2-qkv-bias", init=0.1)
    checked = Checked(DraftModelProposer(Drafter(noisy("qwen2-qkv-bias", 0.3)), PROMPT, greedy(MAX_NEW),
                                         len(PROMPT) + MAX_NEW + 9), PROMPT)
    hybrid = Counting(NgramProposer(PROMPT, 4, 1), checked, "draft")
    ids, _, _ = run(target, hybrid, 8, greedy(MAX_NEW))
    assert ids == run(target, None, 0, greedy(MAX_NEW))[0] and checked.violations == []
    assert hybrid.kept_unchosen > 0  # the premise


@dataclass
class Fixed:
    """A proposer stand-in that offers one fixed draft and records what it was told."""
    draft: Draft
    asked: int = 0
    told: list[Committed] = field(default_factory=list)
    group = EACH

    def propose(self, k: int) -> Draft:
        self.asked += 1
        return self.draft

    def commit(self, step: Committed) -> None:
        self.told.append(step)


STEP = Committed([4, 5, 6], 2, 2, torch.zeros(3, 4))  # 2 accepted drafts, then the target's token


@pytest.mark.parametrize("lookup, drafted, rate_evidence, chosen, drafter_asked", [
    ([0.9, 0.9], [4, 5, 9], 0, "ngram", False),   # the lookup expects 1.7: the draft model does not run
    ([0.3], [4, 5, 9], 0, "draft", True),         # 0.3 vs 1/3 + 1/9 + 1/27 (its prior agreement rate)
    ([0.6, 0.5], [4, 5, 9], 0, "ngram", True),    # 0.9 vs 0.48
    ([0.6, 0.5], [4, 5, 9], 6, "draft", True),    # after 6 fully agreeing steps its rate is 0.95
    ([], [4, 5, 9], 0, "draft", True),            # no match
])
def test_choice_values_a_draft_without_estimates_by_its_agreement(lookup, drafted, rate_evidence, chosen,
                                                                  drafter_asked) -> None:
    ngram = Fixed(Draft([4, 5][:len(lookup)], None, lookup))
    model = Fixed(Draft(drafted))
    hybrid = HybridProposer(ngram, model, "draft")
    for _ in range(rate_evidence):  # steps on which the draft model alone drafted and all was accepted
        hybrid.offered, hybrid.chosen = {"draft": [4, 5, 6]}, "draft"
        hybrid.commit(STEP)
    model.told.clear()
    draft = hybrid.propose(8)
    assert draft.source == chosen
    assert draft.tokens == (ngram if chosen == "ngram" else model).draft.tokens
    assert model.asked == drafter_asked


@pytest.mark.parametrize("chosen", ["ngram", "draft"])
def test_each_part_is_told_how_many_of_its_own_drafts_were_committed(chosen: str) -> None:
    """The chosen part is told the step as the engine saw it; the other the count of its own
    offered tokens that the step committed (a draft model keeps their K/V), whatever was verified."""
    ngram = Fixed(Draft([4, 7], None, [0.1, 0.1]))  # agrees with STEP on 1 token
    model = Fixed(Draft([4, 5, 6, 1]))              # agrees on 3, of which 2 before the target's token
    hybrid = HybridProposer(ngram, model, "draft")
    hybrid.agreement = Acceptance(100.0, 102.0) if chosen == "draft" else Acceptance(0.0, 2.0)
    assert hybrid.propose(8).source == chosen
    hybrid.commit(STEP)
    assert [s.drafted for s in ngram.told] == [STEP.drafted if chosen == "ngram" else 1]
    assert [s.drafted for s in model.told] == [STEP.drafted if chosen == "draft" else 2]
    assert ngram.told[0].tokens == model.told[0].tokens == STEP.tokens
    # a step the draft model was not asked for: none of the committed tokens are its drafts
    ngram.draft = Draft([4, 5, 6], None, [0.99] * 3)
    hybrid.propose(8)
    hybrid.commit(STEP)
    assert model.asked == 1 and model.told[-1].drafted == 0 and ngram.told[-1].drafted == STEP.drafted


def test_sampling_law_through_lookup_then_draft_model() -> None:
    """Drafts come from the draft model (sampled, with q) or the lookup (deterministic); the
    choice never looks at a sampled token, so the law of the output is plain sampling's."""
    target, drafter = tiny16(), Drafter(tiny16_draft())
    counts = torch.zeros([V16] * N_TOKENS, dtype=torch.long)
    drafted = accepted = 0
    chosen: set[str] = set()
    for seed in range(50_000, 50_000 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        hybrid, _ = lookup_draft(drafter.model, PROMPT16, p, SAMPLE_K, drafter)
        ids, origins, stats = run(target, hybrid, SAMPLE_K, p, PROMPT16)
        counts[tuple(ids[:N_TOKENS])] += 1
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        chosen |= {o.source for o in origins if o.source}
    assert chosen == {"ngram", "draft"}  # the premise: both parts' drafts were accepted
    assert_plain_sampling_law(target, counts, drafted, accepted)
    other = plain_law(target, PROMPT16, SamplingParams(temperature=0.75), N_TOKENS)  # negative control
    assert chi_square_p_value(counts, other) < ALPHA


class FakeTarget:
    """A Target (proposers/base.py) by packaged name, with a draft model, a datastore and no head."""

    def __init__(self, name: str | None, model: Transformer, draft: Transformer, tokenizer: Tokenizer) -> None:
        self.name, self.model, self._draft, self._tokenizer = name, model, draft, tokenizer
        self.prefix = None  # no prefix cache (then its draft keeps none either)

    def draft_model(self, name_or_path: str | None = None):
        return type("Loaded", (), {"model": self._draft, "tokenizer": self._tokenizer})()

    def draft_head(self, path: str | None = None):
        raise SpecConfigError("no draft head ships for this model")

    def datastore(self, path: str | None = None) -> Datastore:
        return Datastore(np.array([5, 6, 7]), np.array([3]))  # a datastore of one answer

    def shared(self, key, make):
        return make()  # nothing shared: each request alone


def documented(evidence: str) -> bool:
    """An AUTO_MEASURED entry's evidence, "docs/FILE.md, 'SECTION'", names a section that is there."""
    named = re.fullmatch(r"(docs/\S+\.md), '(.+)'", evidence)
    path = Path(__file__).resolve().parents[1] / named[1] if named else None
    return bool(path and path.is_file()
                and re.search(rf"^#+ {re.escape(named[2])}\b", path.read_text(), re.M))


def test_auto_runs_the_measured_proposer_of_a_packaged_target(tmp_path) -> None:
    target, draft = tiny("llama-gqa-untied", init=0.1), noisy("llama-gqa-untied", 0.3)
    tokenizer = load_hf_tokenizer(save_tokenizer(tmp_path))
    ctx = lambda name: ProposerContext(PROMPT, greedy(MAX_NEW), SpecConfig("auto", k=4),
                                       FakeTarget(name, target, draft, tokenizer))
    for name, measured in AUTO_MEASURED.items():
        assert measured.method in PROPOSERS and documented(measured.evidence), measured.evidence
        proposer = make_auto(ctx(name))
        itself = ctx(name)
        itself.config = SpecConfig(measured.method, k=4)
        assert type(proposer) is type(PROPOSERS[measured.method].factory(itself))
    assert isinstance(make_auto(ctx(None)), NgramProposer)  # no record, no head: prompt lookup
    assert isinstance(make_auto(ctx("unmeasured")), NgramProposer)
    AUTO_MEASURED["tiny"] = Measured("lookup-draft", "a test")
    try:
        proposer = make_auto(ctx("tiny"))
        ids, origins, _ = run(target, proposer, 4, greedy(MAX_NEW))
    finally:
        del AUTO_MEASURED["tiny"]
    assert isinstance(proposer, HybridProposer) and isinstance(proposer.drafter, DraftModelProposer)
    assert ids == run(target, None, 0, greedy(MAX_NEW))[0]
    assert {o.source for o in origins if o.source} == {"ngram", "draft"}
