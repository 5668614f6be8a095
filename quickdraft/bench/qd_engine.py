"""quickdraft as a `BenchEngine` (bench/compare.py): decoding through the engine's plain path, and
single passes through the model's public forward with a KV cache of its own.

Uses only `load_model` and the model's `forward` / `new_cache`, never how weights are held.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from quickdraft.engine.loop import generate_tokens
from quickdraft.spec.sampling import SamplingParams
from quickdraft.weights import LoadedModel, load_model


class QuickdraftEngine:
    name = "quickdraft"

    def __init__(self, loaded: LoadedModel, max_len: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.cache = self.model.new_cache(1, max_len)  # for prefill / feed; decoding has its own
        self.device = self.model.device

    @classmethod
    def load(cls, name_or_path: str, device: str, dtype: torch.dtype, max_len: int,
             activations: str | None = None) -> "QuickdraftEngine":
        return cls(load_model(name_or_path, device=device, dtype=dtype, activations=activations), max_len)

    def stream_greedy(self, prompt: Sequence[int], n: int) -> Iterator[int]:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        for event in generate_tokens(self.model, list(prompt), params, self.loaded.tokenizer.eos_token_ids):
            yield from event.token_ids

    def prefill(self, tokens: Sequence[int]) -> None:
        self.cache.truncate([0])
        self._forward(tokens, last_n=1)

    def feed(self, tokens: Sequence[int]) -> None:
        self._forward(tokens, last_n=len(tokens))  # the LM head over every fed token, as verify does

    def truncate(self, n: int) -> None:
        self.cache.truncate([n])

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], last_n: int) -> None:
        start = self.cache.lengths[0]
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        self.model(ids, positions, self.cache, last_n=last_n)
        self.cache.truncate([start + len(tokens)])
        if self.device.type == "cuda":  # the caller's clock must see the pass finished
            torch.cuda.synchronize(self.device)

