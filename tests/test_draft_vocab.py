"""A draft model's reduced vocabulary (proposers/draft_vocab.py): its LM head over a subset of the
tokens, -inf elsewhere, so q is zero outside the subset.

Oracles: plain greedy decoding of each prompt alone (token for token) with the draft's head
quantized as stored and cut to half the vocabulary, chains and trees; gguf's dequantization of
the rows a cut head keeps; the exact law of the first sampled tokens (chi-square, false failure
1e-6) through a cut draft, with a negative control the same test must reject (a draft cut after
its q was computed: it reports the whole vocabulary's q but draws inside the subset). Premises
counted: drafted tokens all inside the subset, the target's tokens partly outside it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

import quickdraft.proposers.draft_chain as drafter_module
from quickdraft.bench.specbench import parse_methods
from quickdraft.engine.batch import EngineConfig
from quickdraft.errors import QuickdraftError
from quickdraft.kernels.quantized import Part, QuantizedWeight
from quickdraft.proposers.base import Draft, SpecConfig
from quickdraft.proposers.draft_vocab import VocabHead, draft_vocabulary
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams
from quickdraft.weights.tokenizers import load_hf_tokenizer
from support.drafts import first_tokens, members, noisy_draft
from support.engine import Job, greedy, run_batched, target
from support.laws import ALPHA, N_TOKENS, PROMPT16, assert_plain_sampling_law, chi_square_p_value, plain_law
from support.models import tiny16, tiny16_draft
from tiny_tokenizer import save_tokenizer


class Cut(Drafter):
    """A drafter over the vocabulary's lower half that records every token its drafts offer."""

    def __init__(self, model, size: int) -> None:
        super().__init__(model, torch.arange(size))
        self.size = size
        self.offered: list[int] = []

    def propose(self, members, ks) -> list[Draft]:
        drafts = super().propose(members, ks)
        self.offered += [t for d in drafts for t in d.tokens]
        return drafts


@pytest.mark.parametrize("widths", [(1,), (2, 1)])
def test_a_cut_quantized_draft_head_keeps_greedy_equal_to_plain(widths: tuple[int, ...]) -> None:
    model = target()
    draft = noisy_draft(qtype=GGMLQuantizationType.Q8_0)
    assert isinstance(draft.lm_head.weight, QuantizedWeight)  # the premise: the head is cut as stored
    drafter = Cut(draft, model.config.vocab_size // 2)
    violations: list[str] = []
    log = {"trees": 0, "kept": 0}
    make = members(drafter, widths, violations, log)
    batch = [Job([1, 17, 42, 8, 77, 23], greedy(30), make, 4),
             Job([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], greedy(16), make, 6, join_at=1),
             Job([44, 12, 19], greedy(25), make, 3, join_at=2)]
    out, last, engine_violations = run_batched(model, batch, EngineConfig(max_batch=2, policy="fixed"))
    assert engine_violations == [] and violations == []
    plain = [Job(job.prompt, job.params, None, 0).alone(model) for job in batch]
    for i in range(len(batch)):
        assert out[str(i)] == plain[i], f"request {i} differs from plain greedy"
    # premises: drafts only from the subset, accepted and rejected; the target goes outside it
    assert drafter.offered and max(drafter.offered) < drafter.size
    stats = [last[str(i)].stats for i in range(len(batch))]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)
    assert any(t >= drafter.size for p in plain for t in p)
    assert len(widths) == 1 or log["trees"] > 0


def test_the_cut_head_is_the_heads_rows() -> None:
    """Logits inside the subset are the whole head's (the same rows, as stored); -inf outside."""
    draft = noisy_draft(qtype=GGMLQuantizationType.Q8_0)
    vocab = torch.tensor([0, 3, 4, 5, 40, 41, 95])
    hidden = torch.randn(3, draft.config.hidden_size)
    whole, cut = VocabHead(draft, None)(hidden), VocabHead(draft, vocab)(hidden)
    assert torch.equal(whole, draft.logits(hidden))
    torch.testing.assert_close(cut[:, vocab], whole[:, vocab], rtol=1e-5, atol=1e-5)
    outside = torch.ones(draft.config.vocab_size, dtype=torch.bool).index_fill_(0, vocab, False)
    assert torch.isneginf(cut[:, outside]).all()


def test_taken_rows_are_the_stored_rows_in_order() -> None:
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, (rows, 2 * 34), dtype=np.uint8) for rows in (5, 7)]
    for b in blocks:  # finite f16 scales
        b[:, 0:2] = b[:, 34:36] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    weight = QuantizedWeight([Part(GGMLQuantizationType.Q8_0, b) for b in blocks], 64)
    index = [9, 10, 11, 2, 3, 0, 6]  # runs across both parts, out of order
    taken = weight.take(index)
    assert taken.shape == (7, 64) and len(taken.parts) == 3
    assert torch.equal(taken.dequantize(), weight.rows_of(index))
    with pytest.raises(IndexError, match="out of range"):
        weight.take([12])


def test_the_draft_vocabulary_keeps_the_special_tokens(tmp_path) -> None:
    tokenizer = load_hf_tokenizer(save_tokenizer(tmp_path))
    tokenizer.hf.add_special_tokens({"additional_special_tokens": ["<|fim_middle|>"]})  # a high id
    special = set(tokenizer.hf.added_tokens_decoder) | set(tokenizer.eos_token_ids)
    vocab_size = len(tokenizer.hf) + 4
    assert max(special) > 10 and min(special) < 2  # the premise: special ids on both sides of the cut
    vocab = draft_vocabulary(tokenizer, vocab_size, 2)
    assert vocab.tolist() == sorted({0, 1} | special)
    assert draft_vocabulary(tokenizer, vocab_size, 0) is None
    assert draft_vocabulary(tokenizer, vocab_size, vocab_size) is None


def test_sampling_law_through_a_cut_draft() -> None:
    """q is the draft's processed distribution over the subset, zero outside: exact for the target."""
    drafter = Drafter(tiny16_draft(), torch.arange(10))
    counts, drafted, accepted = first_tokens(drafter, 70_000)
    assert 0 < accepted < drafted
    assert_plain_sampling_law(tiny16(), counts, drafted, accepted)


def test_sampling_law_negative_control_a_draft_cut_after_its_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft that reports the whole vocabulary's q but draws inside the subset must fail the same
    test with the same number of requests."""
    real = drafter_module.sample
    inside = torch.zeros(16).index_fill_(0, torch.arange(10), 1.0)
    monkeypatch.setattr(drafter_module, "sample", lambda q, generator: real(q * inside, generator))
    counts, drafted, accepted = first_tokens(Drafter(tiny16_draft()), 70_000)
    assert 0 < accepted < drafted
    law = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0), N_TOKENS)
    assert chi_square_p_value(counts, law) < ALPHA


def test_each_benchmark_row_may_set_its_own_options() -> None:
    methods = parse_methods("draft:4,draft:4@draft-vocab=32768,draft-tree:8@draft_vocab=64@draft-width=2", 8,
                            default_draft="qwen2.5-coder-0.5b")
    assert [m.label for m in methods] == ["plain", "draft:qwen2.5-coder-0.5b k=4",
                                          "draft:qwen2.5-coder-0.5b k=4 draft_vocab=32768",
                                          "draft-tree:qwen2.5-coder-0.5b k=8 draft_vocab=64 draft_width=2"]
    assert methods[2].spec.proposer_options().draft_vocab == 32768
    assert methods[3].spec.proposer_options().draft_width == 2
    for bad in ("draft:4@bogus=1", "draft:4@draft-vocab", "draft:4@draft-vocab=many"):
        with pytest.raises(QuickdraftError, match="draft:4"):
            parse_methods(bad, 8, default_draft="qwen2.5-coder-0.5b")
    assert SpecConfig(method="lookup-draft", options={"draft_vocab": 5}).proposer_options().draft_vocab == 5
