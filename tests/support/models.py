"""Tiny random models (float, GGUF-quantized, a 16-token pair) and the K/V oracle run on them."""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from gguf import GGMLQuantizationType

from quickdraft.model.llama import Transformer
from tiny_models import hf_model, ours_from_hf

# The K-quants' superblocks need hidden 256 (test_spec_exactness's MODELS with @Q4_K, @Q6_K).
K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512)


@functools.lru_cache(maxsize=None)
def tiny(name: str, seed: int = 0, init: float = 0.2, device: str = "cpu", **overrides) -> Transformer:
    """Tiny random model, float32 or (name@Q4_1...) with GGUF-block matrices. init 0.2 spreads the
    logits so greedy output varies; at transformers' 0.02 tiny models fall into loops (useful for
    n-gram acceptance). `device`: float models only (scripts/gpu_check.py runs them on CUDA)."""
    name, _, qtype = name.partition("@")
    qtype, _, activations = qtype.partition("+")
    if qtype.endswith("_K"):
        overrides = {**K_QUANT_SHAPE, **overrides}
    hf = hf_model(name, seed=seed, initializer_range=init, **overrides)
    model = ours_from_hf(hf, qtype=GGMLQuantizationType[qtype] if qtype else None,
                         activation_bits=8 if activations == "int8" else 16)
    return model if device == "cpu" else model.to(device)


V16 = 16


def tiny16(device: str = "cpu") -> Transformer:
    # init 0.35: peaky enough that ~20 joint cells carry most of the mass, flat enough to vary.
    return tiny("llama-gqa-untied", init=0.35, device=device, vocab_size=V16)


@functools.lru_cache(maxsize=None)
def tiny16_draft(device: str = "cpu") -> Transformer:
    """A different model, correlated with the target: its weights plus 10% Gaussian noise, so about
    half the drafts are accepted (with a working draft cache) and recovery and bonus both run."""
    hf = hf_model("llama-gqa-untied", initializer_range=0.35, vocab_size=V16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.1 * param.std())
    model = ours_from_hf(hf)
    return model if device == "cpu" else model.to(device)


def kv_mismatch(model: Transformer, cache, tokens: Sequence[int]) -> float:
    """Largest |K/V difference| between a cache's first len(tokens) slots (row 0) and a fresh
    forward over `tokens` (0.0 when tokens is empty)."""
    n = len(tokens)
    if n == 0:
        return 0.0
    fresh = model.new_cache(1, n)
    with torch.inference_mode():
        model(torch.tensor([list(tokens)]), torch.arange(n)[None], fresh)
    return float((cache.read(0, 0, n) - fresh.read(0, 0, n)).abs().max())


KV_TOL = 1e-4
