"""The draft head proposer: exact like every proposer, fed the target's own features, and saved /
loaded only against the target it was trained for.

Oracles: plain greedy decoding (token for token), the target's hidden states recomputed from
scratch for the features the proposer holds, a fresh head forward for what its cache holds, the
exact law of the first sampled tokens (chi-square).
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import quickdraft
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.engine.loop import generate_tokens
from quickdraft.kernels import QuantizedWeight
from quickdraft.kv.blocks import BlockPool
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.model.rope import inverse_frequencies
from quickdraft.proposers import EACH, Committed, Draft, SpecConfig, SpecConfigError
from quickdraft.proposers.head import DraftHead, HeadProposer, head_config, load_head, on_target, save_head
from quickdraft.proposers.hybrid import HybridProposer
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from support.heads import random_head
from support.laws import N_SAMPLES, N_TOKENS, PROMPT16, SAMPLE_K, SAMPLE_NEW, assert_plain_sampling_law
from support.models import KV_TOL, V16, tiny, tiny16
from tiny_tokenizer import tiny_llm_dir

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]


def target() -> Transformer:
    return tiny("llama-gqa-untied", init=0.1)  # varied text with loops in it


def fused(model: Transformer, seed: int = 0) -> tuple[Transformer, DraftHead]:
    """A copy of the target that keeps every layer's output (tiny models are shared between tests:
    keep_features must not reach the others) and a random head that reads them through a fuse, as
    EAGLE-3's heads read a low, a middle and the top layer."""
    model = copy.deepcopy(model)
    layers = tuple(range(model.config.num_layers))
    model.keep_features(layers)
    torch.manual_seed(seed)
    return model, DraftHead(head_config(model.config), None, layers).requires_grad_(False).eval()


def identity_head(model: Transformer) -> DraftHead:
    """f^_{t+1} = f_t: drafts what the target predicted one position earlier, so loops are accepted
    and anything else rejected (mixed acceptance)."""
    head = random_head(model)
    D = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(D, D), torch.eye(D)], dim=1))
        head.block.wo.weight.zero_()
        head.block.w_down.weight.zero_()
    return head


class CheckedHead(HeadProposer):
    """After each commit: its features equal what the head makes of a fresh forward of a copy of the
    target that keeps exactly the layers the head reads (the target itself may keep more), and its
    cache holds what a fresh head forward over the same pairs writes."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.violations: list[str] = []
        self.reference = copy.copy(self.target)  # the same weights (a module's shallow copy), its own layers
        self.reference.keep_features(self.head.reads(self.target))

    def commit(self, step: Committed) -> None:
        super().commit(step)
        n = self.n_features
        if n != len(self.tokens) - 1:
            self.violations.append(f"{n} features for {len(self.tokens)} tokens")
        with torch.inference_mode():
            fresh = self.head.read(self.reference(torch.tensor([self.tokens[:n]]), torch.arange(n)[None],
                                                  self.target.new_cache(1, n)).features[0])
            diff = float((fresh - self.features[:n]).abs().max())
            if diff > KV_TOL:
                self.violations.append(f"features differ from the target's by {diff:.3g}")
            if self.cached:
                cache = self.head.new_cache(self.cached, self.target.device, self.target.compute_dtype)
                embeds = self.target.embed(torch.tensor([self.tokens[1:self.cached + 1]]))
                self.head(self.features[None, :self.cached], embeds, torch.arange(self.cached)[None], cache)
                diff = float((cache.read(0, 0, self.cached) - self.cache.read(0, 0, self.cached)).abs().max())
                if diff > KV_TOL:
                    self.violations.append(f"head cache differs from a fresh head forward by {diff:.3g}")


def run(model: Transformer, proposer, k: int, params: SamplingParams, prompt=PROMPT) -> tuple[list[int], object]:
    ids, last = [], None
    for event in generate_tokens(model, prompt, params, frozenset(), proposer, k, adaptive=False):
        ids += event.token_ids
        last = event
    return ids, last.stats


def greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def plain() -> tuple[int, ...]:
    return tuple(run(target(), None, 0, greedy())[0])


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kind", ["identity", "random", "random-draft-vocab", "fused"])
def test_greedy_with_a_head_equals_plain(kind: str, k: int) -> None:
    model = target()
    model, head = fused(model, 6) if kind == "fused" else \
        (model, {"identity": lambda: identity_head(model), "random": lambda: random_head(model),
                 "random-draft-vocab": lambda: random_head(model, 5, list(range(0, 96, 2)))}[kind]())
    proposer = CheckedHead(head, model, PROMPT, greedy(), len(PROMPT) + 40 + k + 1)
    ids, stats = run(model, proposer, k, greedy())
    assert ids == list(plain())
    assert proposer.violations == []
    assert stats.drafted_tokens > 0
    if kind == "identity":  # the premise: both accepted and rejected drafts
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("name", ["gemma3-sandwich", "gemma2-softcap", "gptoss", "qwen3moe", "mixtral"])
def test_a_head_for_each_family_with_windows_or_experts_drafts_plain_greedy_tokens(name: str, width: int) -> None:
    """head_config's one layer from a target whose layers differ (sliding and full windows) or carry
    experts: the head builds, drafts as a chain and as a tree (width 2), and the output is plain
    decoding's."""
    model = tiny(name, init=0.1)
    proposer = CheckedHead(identity_head(model), model, PROMPT, greedy(24), len(PROMPT) + 24 + (width + 1) * 4 + 1,
                           width)
    ids, stats = run(model, proposer, 4, greedy(24))
    assert ids == run(model, None, 0, greedy(24))[0]
    assert proposer.violations == [] and stats.drafted_tokens > 0


def recorded(proposer: HeadProposer) -> list[Draft]:
    """The drafts the proposer offers, as it offers them."""
    drafts: list[Draft] = []
    propose = proposer.propose

    def record(k: int) -> Draft:
        drafts.append(propose(k))
        return drafts[-1]
    proposer.propose = record
    return drafts


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("k", [1, 4, 8, 16])
@pytest.mark.parametrize("kind", ["identity", "random-draft-vocab", "fused"])
def test_greedy_with_a_head_tree_equals_plain(kind: str, k: int, width: int) -> None:
    """head-tree: the head's likeliest continuations as a tree, every node verified."""
    model = target()
    model, head = fused(model, 6) if kind == "fused" else \
        (model, identity_head(model) if kind == "identity" else random_head(model, 5, list(range(0, 96, 2))))
    proposer = CheckedHead(head, model, PROMPT, greedy(), len(PROMPT) + 40 + (width + 1) * k + 1, width)
    drafts = recorded(proposer)
    ids, stats = run(model, proposer, k, greedy())
    assert ids == list(plain())
    assert proposer.violations == []  # the tree's nodes never leak into the head's committed cache
    # the premises: trees of up to k nodes with branches, parents before children
    assert stats.drafted_tokens > 0 and all(len(d.tokens) <= k for d in drafts)
    if k > 1:
        assert any(not d.is_chain for d in drafts)
    if kind == "identity":
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_head_tree_rows_in_a_batch_equal_each_alone() -> None:
    """Trees and a chain of one head in one batch, rows verified by the adaptive policy."""
    model = target()
    prompts = [PROMPT, [1, 17, 42, 8, 77], [9, 2, 9, 2, 9, 2]]
    widths = [3, 1, 2]
    engine = Engine(model, EngineConfig(max_batch=3))
    for i, (p, w) in enumerate(zip(prompts, widths)):
        proposer = HeadProposer(identity_head(model), model, p, greedy(30), 128, w)
        engine.add(Request(p, greedy(30), frozenset(), proposer, 6, id=str(i)))
    out = {str(i): [] for i in range(3)}
    while engine.has_work():
        for rid, event in engine.step():
            out[rid] += event.token_ids
    assert [out[str(i)] for i in range(3)] == [run(model, None, 0, greedy(30), p)[0] for p in prompts]


def test_head_rows_in_a_batch_equal_each_alone() -> None:
    model = target()
    prompts = [PROMPT, [1, 17, 42, 8, 77], [9, 2, 9, 2, 9, 2]]
    heads = [identity_head(model), random_head(model, 1), identity_head(model)]
    alone = [run(model, HeadProposer(h, model, p, greedy(30), 64), 4, greedy(30), p)[0] for h, p in zip(heads, prompts)]
    engine = Engine(model, EngineConfig(max_batch=3, policy="fixed"))
    for i, (h, p) in enumerate(zip(heads, prompts)):
        engine.add(Request(p, greedy(30), frozenset(), HeadProposer(h, model, p, greedy(30), 64), 4, id=str(i)))
    out = {str(i): [] for i in range(3)}
    while engine.has_work():
        for rid, event in engine.step():
            out[rid] += event.token_ids
    assert [out[str(i)] for i in range(3)] == alone
    assert alone[0] == list(plain())[:30]


def test_hybrid_takes_the_lookup_where_text_repeats_and_the_head_elsewhere() -> None:
    model = target()
    head = CheckedHead(identity_head(model), model, PROMPT, greedy(), len(PROMPT) + 40 + 9)
    ngram = NgramProposer(PROMPT, 4, 2)
    sources = {id(ngram): "ngram", id(head): "head"}
    offered: list[tuple[str, int]] = []
    for part in (ngram, head):
        def propose(k, part=part, inner=part.propose):
            draft = inner(k)
            offered.append((sources[id(part)], len(draft.tokens)))
            return draft
        part.propose = propose
    ids, stats = run(model, HybridProposer(ngram, head), 8, greedy())
    assert ids == list(plain()) and head.violations == []
    assert stats.drafted_tokens > 0
    asked = [source for source, _ in offered]  # the premise: both proposers drafted
    assert asked.count("ngram") == stats.target_passes - 1 and asked.count("head") > 0


class Fixed:
    """A proposer stand-in that offers one fixed draft and records what it was told."""
    group = EACH

    def __init__(self, draft: Draft) -> None:
        self.draft, self.asked, self.committed, self.verified = draft, 0, [], []

    def propose(self, k: int) -> Draft:
        self.asked += 1
        return self.draft

    def commit(self, step: Committed) -> None:
        self.committed.append(list(step.tokens))
        self.verified.append(step.verified)


@pytest.mark.parametrize("lookup, head, chosen, head_asked", [
    ([0.9, 0.9, 0.9], [0.9] * 8, "lookup", False),   # 2.4 expected: the head does not run
    ([0.3, 0.3], [0.8, 0.5], "head", True),          # 0.39 vs 1.2
    ([0.6, 0.5], [0.4, 0.2], "lookup", True),        # 0.9 vs 0.48
    ([], [0.2], "head", True),                       # no match
])
def test_hybrid_choice(lookup, head, chosen, head_asked) -> None:
    drafts = {"lookup": Draft([1] * len(lookup), None, lookup),
              "head": Draft([2] * len(head), None, head)}
    ngram, heads = Fixed(drafts["lookup"]), Fixed(drafts["head"])
    hybrid = HybridProposer(ngram, heads)
    draft = hybrid.propose(8)
    assert (draft.tokens, draft.accept_probs) == (drafts[chosen].tokens, drafts[chosen].accept_probs)
    assert heads.asked == head_asked
    hybrid.commit(Committed([7, 8], 1, 1, torch.zeros(2, 4)))
    assert ngram.committed == heads.committed == [[7, 8]]  # both follow every step
    # only the chosen part's draft was verified: a head whose draft was not taken hears 0 (and rests)
    assert (ngram.verified, heads.verified) == (([1], [0]) if chosen == "lookup" else ([0], [1]))


@pytest.mark.parametrize("vocab", [None, [0, 2, 3, 5, 7, 8, 11, 13, 14], "hybrid", "tree", "fused"],
                         ids=["whole-vocab", "draft-vocab", "hybrid", "head-tree", "fused"])
def test_sampling_law_with_a_head(vocab) -> None:
    """A draft vocabulary makes q zero on the other tokens: still exact. So is the hybrid, whose
    drafts come from the head (sampled, with q) or the n-gram proposer (deterministic), and the
    head's trees (deterministic siblings, recursive rejection)."""
    model = tiny16()
    model, head = fused(model, 2) if vocab == "fused" else \
        (model, random_head(model, 2, None if vocab in ("hybrid", "tree") else vocab))
    counts = torch.zeros([V16] * N_TOKENS, dtype=torch.long)
    drafted = accepted = 0
    for seed in range(40_000, 40_000 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = HeadProposer(head, model, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + 4 * SAMPLE_K + 1,
                                3 if vocab == "tree" else 1)
        if vocab == "hybrid":
            proposer = HybridProposer(NgramProposer(PROMPT16, 3, 1), proposer)
        ids, stats = run(model, proposer, SAMPLE_K, p, PROMPT16)
        counts[tuple(ids[:N_TOKENS])] += 1
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    assert_plain_sampling_law(model, counts, drafted, accepted)


def test_save_load_and_the_wrong_target(tmp_path: Path) -> None:
    model = target()
    head = random_head(model, 3)
    path = save_head(head, model, tmp_path / "head", "tiny-target", training={"steps": 0})
    loaded = load_head(path, model)
    for name, tensor in head.state_dict().items():  # weights saved in bfloat16, the vocabulary as is
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        torch.testing.assert_close(loaded.state_dict()[name], expected)
    with pytest.raises(SpecConfigError, match="trained for 'tiny-target'"):
        load_head(path, tiny("llama-gqa-untied", seed=5, init=0.1))
    with pytest.raises(SpecConfigError, match="trained for"):
        load_head(path, tiny("qwen2-qkv-bias"))
    (path / "head.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecConfigError, match="cannot read a draft head"):
        load_head(path, model)
    with pytest.raises(SpecConfigError, match="cannot read a draft head"):
        load_head(tmp_path / "nowhere", model)


def test_a_head_of_its_own_mlp_width_round_trips_and_drafts_exactly(tmp_path: Path) -> None:
    """A head narrower than its target's layers (a large target's MLP would make training slow):
    head.json records the width, loading builds that shape, drafting stays exact; old head.json
    files without it mean the target's width, and a bad one is refused by name."""
    model = target()
    torch.manual_seed(4)
    head = DraftHead(head_config(model.config, mlp_width=24)).requires_grad_(False).eval()
    assert head.block.w_down.weight.shape[-1] == 24 != model.config.intermediate_size
    path = save_head(head, model, tmp_path / "narrow", "tiny-target")
    info = json.loads((path / "head.json").read_text())
    assert info["mlp_width"] == 24
    loaded = load_head(path, model)
    assert loaded.config.intermediate_size == 24
    ids, _ = run(model, HeadProposer(loaded, model, PROMPT, greedy(), len(PROMPT) + 48), 4, greedy())
    assert ids == list(plain())
    wide = save_head(random_head(model), model, tmp_path / "wide", "tiny-target")
    old = {k: v for k, v in json.loads((wide / "head.json").read_text()).items() if k != "mlp_width"}
    (wide / "head.json").write_text(json.dumps(old))
    assert load_head(wide, model).config.intermediate_size == model.config.intermediate_size
    for bad in (-1, "24", 2.5):
        (path / "head.json").write_text(json.dumps({**info, "mlp_width": bad}))
        with pytest.raises(SpecConfigError, match="mlp_width"):
            load_head(path, model)
    (path / "head.json").write_text(json.dumps({**info, "mlp_width": 32}))
    with pytest.raises(SpecConfigError, match="does not fit this target"):
        load_head(path, model)


def test_a_fused_head_saves_its_layers_and_runs_only_where_the_target_keeps_them(tmp_path: Path) -> None:
    """A head that reads several layers: head.json names them, the fuse round-trips, the proposer
    refuses a target that keeps other features (a head's shapes would fit by chance otherwise),
    and an LLM loaded with the head keeps its layers' features, in its prefix cache too: spec ==
    plain, fresh and on a prefix hit; a request's head that reads other layers is a clear error."""
    model, head = fused(target(), 3)
    path = save_head(head, model, tmp_path / "fused", "tiny-target")
    assert json.loads((path / "head.json").read_text())["feature_layers"] == [0, 1]
    fresh = copy.deepcopy(target())
    with pytest.raises(SpecConfigError, match=r"reads the target's layers \[0, 1\], and the model keeps the features "
                                              r"of layers \[1\]: load the model with this head"):
        HeadProposer(load_head(path, fresh), fresh, PROMPT, greedy(), 64)
    fresh.keep_features((0, 1))
    loaded = load_head(path, fresh)
    torch.testing.assert_close(loaded.fuse.weight, head.fuse.weight.to(torch.bfloat16).float())
    ids, _ = run(fresh, HeadProposer(loaded, fresh, PROMPT, greedy(), len(PROMPT) + 48), 4, greedy())
    assert ids == list(plain())
    info = json.loads((path / "head.json").read_text())
    for layers in ([1, 0], [0], [0, 1, 2], "1"):
        (path / "head.json").write_text(json.dumps({**info, "feature_layers": layers}))
        with pytest.raises(SpecConfigError, match="feature_layers .* are not ascending layers of this target"):
            load_head(path, fresh)
    (path / "head.json").write_text(json.dumps(info))

    model_dir = tiny_llm_dir(tmp_path / "model")
    llm = quickdraft.load(str(model_dir))
    L, D = llm.model.config.num_layers, llm.model.config.hidden_size
    head_dir = save_head(fused(llm.model, 4)[1], llm.model, tmp_path / "head", "tiny")
    plain_llm = quickdraft.load(str(model_dir))
    assert plain_llm.model.feature_layers == (L - 1,) and plain_llm.prefix.feature_width == D
    llm = quickdraft.load(str(model_dir), spec=SpecConfig("head", k=3, head=str(head_dir), adaptive=False))
    assert llm.model.feature_layers == tuple(range(L)) and llm.prefix.feature_width == L * D
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = plain_llm.generate("hello there, hello there", params=params).token_ids
    first = llm.generate("hello there, hello there", params=params)
    again = llm.generate("hello there, hello there", params=params)  # its prompt's K/V and features cached
    assert first.token_ids == again.token_ids == expected and first.stats.drafted_tokens > 0
    assert again.stats.cached_tokens > 0 and again.stats.drafted_tokens > 0
    # a head that reads the last layer alone reads its columns of them
    other = save_head(random_head(llm.model, 5), llm.model, tmp_path / "last-layer", "tiny")
    # (adaptive off: the policy would verify a random head's drafts or not by the step times measured)
    out = llm.generate("hello there, hello there", params=params,
                       spec=SpecConfig("head", k=3, head=str(other), adaptive=False))
    assert out.token_ids == expected and out.stats.drafted_tokens > 0
    # a model loaded plainly keeps the layers of a head named before its engine is made, not after
    late = quickdraft.load(str(model_dir))
    late.draft_head(str(head_dir))
    assert late.model.feature_layers == tuple(range(L)) and late.prefix.feature_width == L * D
    assert late.generate("hello there, hello there", params=params,
                         spec=SpecConfig("head", k=3, head=str(head_dir))).token_ids == expected
    plain_llm.generate("hello", params=params)  # its engine now runs, keeping the last layer's features
    with pytest.raises(SpecConfigError, match=r"engine already runs keeping the features of layers \[1\]"):
        plain_llm.generate("hello", params=params, spec=SpecConfig("head", k=3, head=str(head_dir)))


def test_heads_reading_some_of_the_kept_layers_read_their_own_columns_fresh_and_from_the_prefix_cache() -> None:
    """A model keeping layers 0, 1 and 2 with heads that read (0, 2), (2,) and all three in one
    engine batch over a prefix cache: each head's features are what it reads of a fresh forward
    (CheckedHead), on the first request and on the second, whose prompt's features come from the
    cache; every output is plain greedy decoding's."""
    model = copy.deepcopy(tiny("llama-gqa-untied", init=0.1, num_hidden_layers=3))
    model.keep_features((0, 1, 2))
    torch.manual_seed(7)
    heads = [DraftHead(head_config(model.config), None, layers).requires_grad_(False).eval()
             for layers in ((0, 2), (), (0, 1, 2))]
    expected = run(model, None, 0, greedy(24))[0]
    prefix = PrefixCache(64 << 20, model.config, model.compute_dtype, model.feature_width,
                         pool=BlockPool(model.config, model.compute_dtype, model.device))
    engine = Engine(model, EngineConfig(max_batch=3), prefix=prefix)
    for round_ in range(2):
        proposers = [CheckedHead(h, model, PROMPT, greedy(24), 64) for h in heads]
        for i, proposer in enumerate(proposers):
            engine.add(Request(PROMPT, greedy(24), frozenset(), proposer, 4, id=f"{round_}-{i}"))
        out, cached = {}, {}
        while engine.has_work():
            for rid, event in engine.step():
                out[rid] = out.get(rid, []) + event.token_ids
                cached[rid] = event.stats.cached_tokens
        assert all(out[f"{round_}-{i}"] == expected for i in range(3))
        assert all(p.violations == [] and p.n_features > len(PROMPT) for p in proposers)
    assert all(cached[f"1-{i}"] > 0 for i in range(3))  # the second round's prompts came from the cache
    narrow = PrefixCache(64 << 20, model.config, model.compute_dtype, pool=BlockPool(model.config, model.compute_dtype))
    with pytest.raises(ValueError, match="prefix cache keeps 64 features per token, the model hands over 192"):
        Engine(model, EngineConfig(max_batch=3), prefix=narrow)


def test_a_head_on_a_bfloat16_target_keeps_float32_rotary_frequencies() -> None:
    """Off the CPU a target computes in its weights' dtype: the head follows, but its rotary
    frequencies must stay the float32 ones the target and training use (bfloat16 rounds them by up
    to 0.4%). A CPU target computes in float32, so a stand-in says what CUDA would."""
    model = target()
    bf16_target = SimpleNamespace(device=model.device, compute_dtype=torch.bfloat16)
    head = on_target(random_head(model), bf16_target)
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.inv_freq.dtype == torch.float32 and torch.equal(head.inv_freq, inverse_frequencies(head.config))


def test_head_through_the_api_and_spec_config(tmp_path: Path) -> None:
    model_dir = tiny_llm_dir(tmp_path / "model")
    llm = quickdraft.load(str(model_dir))
    head_dir = save_head(random_head(llm.model, 4), llm.model, tmp_path / "head", "tiny")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain_out = llm.generate("hello there", params=params)
    spec = SpecConfig("head", k=3, head=str(head_dir), adaptive=False)  # a random head: verify all it offers
    spec_out = llm.generate("hello there", params=params, spec=spec)
    assert spec_out.token_ids == plain_out.token_ids and spec_out.stats.drafted_tokens > 0
    with pytest.raises(SpecConfigError, match="no draft head ships .* --head"):  # none for a tiny model
        llm.generate("hello there", params=params, spec=SpecConfig("head", k=3))
    # "auto": the hybrid when a head is named or ships for the model, else prompt lookup alone
    ids = llm.prompt_ids("hello there")
    assert isinstance(llm.proposer(ids, params, SpecConfig("auto", k=3)), NgramProposer)
    assert isinstance(llm.proposer(ids, params, SpecConfig("auto", k=3, head=str(head_dir))), HybridProposer)
    for method in ("auto", "hybrid", "head-tree"):
        out = llm.generate("hello there", params=params, spec=SpecConfig(method, k=3, head=str(head_dir)))
        assert out.token_ids == plain_out.token_ids
    spec = SpecConfig("head-tree", k=6, head=str(head_dir), adaptive=False, options={"head_width": 3})
    out = llm.generate("hello there", params=params, spec=spec)
    assert out.token_ids == plain_out.token_ids and out.stats.drafted_tokens > 0
    with pytest.raises(SpecConfigError, match="head_width must be in 2..16"):
        SpecConfig("head-tree", k=6, head=str(head_dir), options={"head_width": 1})


def test_a_head_over_a_quantized_target_runs_as_q8_0_blocks_and_stays_exact(tmp_path: Path) -> None:
    """Over a target whose matrices run as GGUF blocks the head's matrices become Q8_0 blocks and
    its vocabulary's output rows stay the target's blocks (a quarter of the bytes per draft step);
    greedy output is still the target's own, and the quantized head drafts what the float one does
    nearly everywhere (a random head's logits are far apart)."""
    llm = quickdraft.load(str(tiny_llm_dir(tmp_path / "model")), quantize="int8")
    float_head = random_head(llm.model, 4)
    head_dir = save_head(float_head, llm.model, tmp_path / "head", "tiny")
    head = llm.draft_head(str(head_dir))
    matrices = (head.fc, head.block.wqkv, head.block.wo, head.block.w_gate_up, head.block.w_down)
    assert all(isinstance(m.weight, QuantizedWeight) and m.weight.types == "Q8_0" for m in matrices)
    assert isinstance(head.output_rows(llm.model), QuantizedWeight)
    assert head.output_rows(llm.model) is head.output_rows(llm.model)  # made once, not per request
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain_out = llm.generate("hello there", params=params)
    for method in ("head", "hybrid", "head-tree"):
        out = llm.generate("hello there", params=params, spec=SpecConfig(method, k=3, head=str(head_dir),
                                                                          adaptive=False))
        assert out.token_ids == plain_out.token_ids and out.stats.drafted_tokens > 0, method
    prompt = llm.prompt_ids("hello there") + plain_out.token_ids
    ours = HeadProposer(head, llm.model, prompt, greedy(1), 128)
    theirs = HeadProposer(on_target(float_head.to(torch.bfloat16).float(), llm.model), llm.model, prompt, greedy(1), 128)
    with torch.inference_mode():
        features = llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                             llm.model.new_cache(1, len(prompt))).hidden[0]
    same, seen = 0, []
    for n in range(2, len(prompt)):
        drafts = []
        for proposer in (ours, theirs):
            proposer.features[:n], proposer.n_features, proposer.tokens = features[:n], n, prompt[:n + 1]
            proposer.cached = 0
            drafts.append(proposer.propose(1).tokens)
        seen.append(drafts[0])
        same += drafts[0] == drafts[1]
    assert len(set(map(tuple, seen))) > (len(prompt) - 2) // 2  # drafts that vary: the comparison means something
    assert same >= 0.8 * (len(prompt) - 2)


def test_a_head_that_is_never_right_costs_little() -> None:
    """An unsure head stops drafting early: about one draft token per step instead of k, and its
    low estimates make the draft-length policy verify fewer still (greedy output stays exact
    either way)."""
    model = target()

    def run_with(adaptive: bool):
        head = random_head(model, 7, list(range(50, 96)))  # drafts only tokens the target rarely picks
        proposer = HeadProposer(head, model, PROMPT, greedy(), len(PROMPT) + 49)
        events = list(generate_tokens(model, PROMPT, greedy(), frozenset(), proposer, 8, adaptive=adaptive))
        return events[-1].stats, [t for e in events for t in e.token_ids]

    (offered, ids_offered), (verified, ids_verified) = run_with(False), run_with(True)
    assert ids_offered == ids_verified == list(plain())
    assert offered.accepted_tokens <= 2 and offered.drafted_tokens <= 1.5 * offered.target_passes
    assert verified.drafted_tokens < offered.drafted_tokens
