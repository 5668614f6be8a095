"""The speed half of the GPU check (gpu_check.py): random models of real shapes (Qwen2.5-1.5B as the
target, Qwen2.5-0.5B as its draft) in bfloat16, timed against transformers' `generate` on the same
weights. Random weights make no sensible text, which timing does not need.

What each figure is, all greedy, `new` tokens after a `prompt`-token random prompt:
- plain: quickdraft's engine (generate_tokens) vs transformers' generate (its default attention),
  interleaved A B, medians; tok_s counts the prefill, decode_tok_s does not (transformers' by
  subtracting a 1-token generate of the same prompt).
- forward_cost: t(q)/t(1) of one target pass over q new tokens after a cached context
  (quickdraft.engine.cost, the LM head over every fed token as verification runs it).
- spec: speculative decoding at forced acceptance: verification runs as always (the pass over
  k+1 tokens, verify() and its host sync), then every draft token is taken as accepted, so each
  pass commits k+1 tokens and the proposer keeps its whole draft, as with a draft that is always
  right. `free` drafts cost nothing (the pass structure alone); `draft` drafts with the 0.5B-shaped
  model through the batched drafter (k forwards per step, over a 65,536-token draft vocabulary).
"""
from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence
from unittest import mock

import torch

from quickdraft.bench.hf_reference import hf_greedy
from quickdraft.engine import scores
from quickdraft.engine.cost import measure_forward_cost
from quickdraft.engine.loop import generate_tokens
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, Committed, Draft
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams
from quickdraft.spec.verify import Verdict


@dataclass(frozen=True)
class Shapes:
    common: dict[str, Any]  # transformers Qwen2Config fields both models share
    target: dict[str, Any]
    draft: dict[str, Any]
    dtype: torch.dtype
    prompt: int             # tokens
    new: int                # tokens generated per run
    q_max: int              # forward cost for q = 1..q_max
    context: int            # the forward cost's cached context
    ks_free: tuple[int, ...]
    ks_draft: tuple[int, ...]
    repeats: int
    draft_vocab: int


QWEN = dict(vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
FULL = Shapes(QWEN, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
              dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2),
              torch.bfloat16, 128, 128, 17, 256, (1, 2, 4, 8, 16), (2, 4, 8), 3, 65536)
TINY = Shapes({**QWEN, "vocab_size": 512, "max_position_embeddings": 256},
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2),
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1),
              torch.float32, 16, 16, 5, 32, (2,), (2,), 1, 256)


def random_model(common: dict[str, Any], shape: dict[str, Any], dtype: torch.dtype, device: str,
                 seed: int) -> tuple[torch.nn.Module, Transformer]:
    """transformers' Qwen2 with its random initialisation, and ours built from the same tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        hf = Qwen2ForCausalLM(Qwen2Config(**common, **shape))
    hf = hf.to(dtype).eval()
    ours = build_transformer(ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), device=device,
                             dtype=dtype)
    return hf, ours


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(model: Transformer, prompt: Sequence[int], n: int, proposer: Any = None, k: int = 0) -> dict[str, Any]:
    """One greedy generation; every event comes after the step's host sync, so its time is honest."""
    _sync(model.device)
    t0, stamps, ids, stats = time.perf_counter(), [], [], None
    for event in generate_tokens(model, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), frozenset(),
                                 proposer, k, adaptive=False):
        stamps.append(time.perf_counter())
        ids += event.token_ids
        stats = event.stats
    total, first = stamps[-1] - t0, stamps[0] - t0
    return {"tok_s": len(ids) / total, "decode_tok_s": (len(ids) - 1) / (total - first), "first_s": first,
            "tokens_per_pass": stats.tokens_per_pass, "acceptance": stats.acceptance_rate, "ids": ids}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "ids"}


class Free:
    """Drafts k copies of one token at no cost: with acceptance forced, the pass structure alone."""
    group = EACH

    def propose(self, k: int) -> Draft:
        return Draft([7] * k)

    def commit(self, step: Committed) -> None:
        pass


@contextmanager
def forced_acceptance() -> Iterator[None]:
    """The engine's verify, then every draft node of each (chain) row kept: see the module docstring."""
    real = scores.verify

    def forced(drafts: Sequence[Draft], logits: torch.Tensor, params: Any, generators: Any, masks: Any = None,
               generated: Any = None) -> Verdict:
        verdict = real(drafts, logits, params, generators, masks)
        assert all(d.is_chain for d in drafts)
        return Verdict([list(range(len(d.tokens))) for d in drafts],
                       [d.tokens + tokens[-1:] for d, tokens in zip(drafts, verdict.tokens)])

    with mock.patch.object(scores, "verify", forced):
        yield


def plain(report: Any, shapes: Shapes, hf: torch.nn.Module, ours: Transformer, prompt: list[int]) -> float:
    timed(ours, prompt, 8)
    hf_greedy(hf, prompt, 8, ignore_eos=True)
    runs, theirs, theirs_1 = [], [], []
    for _ in range(shapes.repeats):
        runs.append(timed(ours, prompt, shapes.new))
        ids, seconds = hf_greedy(hf, prompt, shapes.new, ignore_eos=True)
        theirs.append(seconds)
        theirs_1.append(hf_greedy(hf, prompt, 1, ignore_eos=True)[1])
    same = next((i for i, (a, b) in enumerate(zip(runs[-1]["ids"], ids)) if a != b), min(len(ids), shapes.new))
    hf_s, hf_1 = statistics.median(theirs), statistics.median(theirs_1)
    record = {"quickdraft": medians(runs), "transformers": {"tok_s": shapes.new / hf_s,
              "decode_tok_s": (shapes.new - 1) / (hf_s - hf_1), "first_s": hf_1},
              "attention": hf.config._attn_implementation, "same_tokens_as_transformers_for": same}
    record["decode_ratio"] = record["quickdraft"]["decode_tok_s"] / record["transformers"]["decode_tok_s"]
    report.put("speed", "plain", record)
    return record["quickdraft"]["decode_tok_s"]


def spec(report: Any, shapes: Shapes, ours: Transformer, draft: Transformer, prompt: list[int],
         plain_decode: float, deadline: float) -> None:
    vocab = torch.arange(shapes.draft_vocab) if shapes.draft_vocab < draft.config.vocab_size else None

    def drafting(k: int) -> DraftModelProposer:
        params = SamplingParams(max_new_tokens=shapes.new, ignore_eos=True)
        return DraftModelProposer(Drafter(draft, vocab), prompt, params, len(prompt) + shapes.new + k + 1)

    with forced_acceptance():
        for kind, ks in (("free", shapes.ks_free), ("draft", shapes.ks_draft)):
            make = (lambda k: Free()) if kind == "free" else drafting
            timed(ours, prompt, 8, make(ks[0]), ks[0])  # warm-up
            for k in ks:
                if time.perf_counter() > deadline:
                    report.put("speed", f"spec_{kind}_k{k}", "skipped: out of time")
                    continue
                m = medians([timed(ours, prompt, shapes.new, make(k), k) for _ in range(shapes.repeats)])
                m["decode_speedup_vs_plain"] = m["decode_tok_s"] / plain_decode
                m["forced"] = m["acceptance"] == 1.0  # else the engine no longer verifies through scores.verify
                report.put("speed", f"spec_{kind}_k{k}", m)
                report.say(f"  spec {kind} k={k}: {m['decode_tok_s']:.1f} tok/s decode, "
                           f"{m['decode_speedup_vs_plain']:.2f}x plain, {m['tokens_per_pass']:.2f} tokens/pass")


def run(report: Any, shapes: Shapes, device: str, deadline: float) -> None:
    """Plain decoding vs transformers, the forward-cost curve, then speculation at forced
    acceptance (its cases skipped once past `deadline`, perf_counter seconds)."""
    hf, ours = random_model(shapes.common, shapes.target, shapes.dtype, device, seed=0)
    report.put("speed", "what", __doc__)
    report.put("speed", "shapes", {"target": shapes.target, "draft": shapes.draft, "common": shapes.common,
                                   "dtype": str(shapes.dtype), "prompt": shapes.prompt, "new": shapes.new})
    prompt = torch.randint(shapes.common["vocab_size"], (shapes.prompt,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    plain_decode = plain(report, shapes, hf, ours, prompt)
    report.say(f"  plain: {json.dumps(report.data['sections']['speed']['plain'])}")
    del hf
    cost = measure_forward_cost(ours, range(1, shapes.q_max + 1), context_len=shapes.context, repeats=5)
    report.put("speed", "forward_cost", {"context": shapes.context, "t1_ms": cost.t1_s * 1000,
                                         "ratios": {str(q): round(r, 3) for q, r in cost.ratios.items()}})
    report.say(f"  t(q)/t(1): {report.data['sections']['speed']['forward_cost']}")
    hf_draft, draft = random_model(shapes.common, shapes.draft, shapes.dtype, device, seed=1)
    del hf_draft
    draft_cost = measure_forward_cost(draft, [1], context_len=shapes.context, repeats=5)
    report.put("speed", "draft_t1_ms", draft_cost.t1_s * 1000)
    spec(report, shapes, ours, draft, prompt, plain_decode, deadline)
    if device == "cuda":
        report.put("speed", "max_memory_gib", torch.cuda.max_memory_allocated() / 2**30)
