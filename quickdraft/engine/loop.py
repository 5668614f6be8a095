"""The decoding loop for one request: prefill, then one target pass per step.

Yields a TokenEvent per step; a consumer that stops iterating (stop string found, client gone)
simply closes the generator.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from quickdraft.engine.events import GenerationStats, TokenEvent
from quickdraft.errors import ContextTooLong
from quickdraft.model.llama import Transformer
from quickdraft.sampling import SamplingParams, probabilities, sample


def check_context(prompt_len: int, context: int) -> None:
    if prompt_len == 0:
        raise ContextTooLong("the prompt is empty; expected at least one token")
    if prompt_len >= context:
        raise ContextTooLong(
            f"the prompt has {prompt_len} tokens but the model's context holds {context}; "
            f"expected at most {context - 1} so at least one token can be generated")


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> tokens [B]."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, params), generator)


@torch.inference_mode()
def generate_tokens(model: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
                    eos_token_ids: frozenset[int] = frozenset()) -> Iterator[TokenEvent]:
    context = model.config.max_position_embeddings
    n_prompt = len(prompt_ids)
    check_context(n_prompt, context)
    budget = min(params.max_new_tokens, context - n_prompt)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    cache = model.new_cache(1, n_prompt + budget)
    generator = params.make_generator(model.device)
    stats = GenerationStats(prompt_tokens=n_prompt)
    start = time.perf_counter()

    tokens = torch.tensor([list(prompt_ids)], device=model.device)
    positions = torch.arange(n_prompt, device=model.device)[None]
    length = 0
    while True:
        logits = model(tokens, positions, cache, last_n=1).logits
        length += tokens.shape[1]
        cache.truncate([length])
        stats.target_passes += 1
        token = next_token(logits[:, -1], params, generator)
        token_id = int(token)  # the step's one host sync
        stats.new_tokens += 1
        stats.total_s = time.perf_counter() - start
        if stats.new_tokens == 1:
            stats.ttft_s = stats.total_s
        if token_id in stop_ids:
            stats.new_tokens -= 1  # the stop token is not part of the output
            yield TokenEvent([], "stop", replace(stats))
            return
        finish = "length" if stats.new_tokens >= budget else None
        yield TokenEvent([token_id], finish, replace(stats))
        if finish:
            return
        tokens = token.view(1, 1)
        positions = torch.tensor([[length]], device=model.device)
