"""The decoding loop for one request: admit -> propose -> one target pass -> verify -> truncate
-> commit -> emit. Plain decoding is the same loop with no proposer (k = 0).

Yields a TokenEvent per step; a consumer that stops iterating (stop string found, client gone)
simply closes the generator.
"""
from __future__ import annotations

import copy
import time
from typing import Iterator, Sequence

import torch

from quickdraft.cache import KVCache
from quickdraft.engine.events import FinishReason, GenerationStats, TokenEvent
from quickdraft.engine.policy import DraftLengthPolicy
from quickdraft.errors import ContextTooLong
from quickdraft.model.llama import Transformer
from quickdraft.sampling import SamplingParams
from quickdraft.spec.base import Draft, Proposer
from quickdraft.verify import verify

NO_DRAFT = Draft([], None)


def check_context(prompt_len: int, context: int) -> None:
    if prompt_len == 0:
        raise ContextTooLong("the prompt is empty; expected at least one token")
    if prompt_len >= context:
        raise ContextTooLong(
            f"the prompt has {prompt_len} tokens but the model's context holds {context}; "
            f"expected at most {context - 1} so at least one token can be generated")


def _cut_at_stop(new: list[int], stop_ids: set[int], remaining: int) -> tuple[list[int], FinishReason | None]:
    """The tokens to emit out of a step's `new` ones: a stop token or the budget inside an accepted
    run ends generation there and drops what follows."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[:i], "stop"
        if i + 1 >= remaining:
            return new[:i + 1], "length"
    return new, None


@torch.inference_mode()
def generate_tokens(model: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
                    eos_token_ids: frozenset[int] = frozenset(), proposer: Proposer | None = None,
                    k: int = 0, cache: KVCache | None = None, adaptive: bool = True
                    ) -> Iterator[TokenEvent]:
    """Tokens of one request. `cache` (batch 1, room for prompt + max_new_tokens) may be passed
    in to be inspected: after each event it holds every committed token but the newest.
    `adaptive` lets DraftLengthPolicy verify only the part of a draft expected to pay off."""
    context = model.config.max_position_embeddings
    n_prompt = len(prompt_ids)
    check_context(n_prompt, context)
    budget = min(params.max_new_tokens, context - n_prompt)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    device = model.device
    if cache is None:
        cache = model.new_cache(1, n_prompt + budget)
    elif cache.batch_size != 1 or cache.max_len < n_prompt + budget:
        raise ValueError(f"cache needs batch 1 and room for {n_prompt + budget} tokens")
    generator = params.make_generator(device)
    stats = GenerationStats(prompt_tokens=n_prompt)
    policy = DraftLengthPolicy(k)
    start = time.perf_counter()

    feed = list(prompt_ids)  # tokens to run before the draft: the prompt, then the last token
    length = 0               # tokens whose K/V are in the cache
    draft = NO_DRAFT         # the prefill step drafts nothing, exactly like plain decoding
    while True:
        t0 = time.perf_counter()
        n_draft = len(draft.tokens)
        ids = torch.tensor([feed + draft.tokens], device=device)
        positions = torch.arange(length, length + ids.shape[1], device=device)[None]
        logits = model(ids, positions, cache, last_n=n_draft + 1).logits  # [1, n_draft+1, V]
        verdict = verify(torch.tensor([draft.tokens], dtype=torch.long, device=device), [n_draft],
                         None if draft.q is None else draft.q[None], logits, [params], [generator])
        accepted, new = verdict.accepted[0], verdict.tokens[0]
        length += len(feed) + accepted  # rejected drafts' K/V are evicted: a length change
        cache.truncate([length])
        stats.target_passes += 1
        stats.record_draft(n_draft, accepted)
        step_s = time.perf_counter() - t0
        stats.verify_s += step_s
        if len(feed) == 1:  # the prefill's time says nothing about decode steps
            policy.observe(1 + n_draft, step_s)

        emitted, finish = _cut_at_stop(new, stop_ids, budget - stats.new_tokens)
        if finish == "stop":  # drafts accepted after the stop token leave the cache too
            length -= accepted - len(emitted)
            cache.truncate([length])
        stats.new_tokens += len(emitted)
        stats.committed_tokens += len(emitted) + (finish == "stop" and len(emitted) < len(new))
        stats.total_s = time.perf_counter() - start
        if stats.ttft_s == 0.0 and (emitted or finish):
            stats.ttft_s = stats.total_s
        yield TokenEvent(emitted, finish, copy.deepcopy(stats))
        if finish:
            return
        feed = new[-1:]
        if proposer is not None and k > 0:
            t1 = time.perf_counter()
            proposer.commit(new, accepted)
            draft = proposer.propose(min(k, budget - stats.new_tokens - 1))
            if adaptive:
                draft = draft.prefix(policy.choose(len(draft.tokens), draft.accept_prob))
            stats.propose_s += time.perf_counter() - t1
