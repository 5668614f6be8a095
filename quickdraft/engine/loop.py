"""One request decoded alone on a bare model (tests, training, kernel benchmarks): an engine of
one row of its own, driven by the caller (engine/service.py). `LLM` goes through its model's
shared engine service instead.

Plain decoding is the same loop with no proposer (k = 0). A consumer that stops iterating (stop
string found, client gone) simply closes the generator.
"""
from __future__ import annotations

from contextlib import closing
from typing import Iterator, Sequence

from quickdraft.engine.batch import Engine, EngineConfig, Request, check_context
from quickdraft.engine.events import TokenEvent
from quickdraft.engine.service import EngineService
from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.spec.draft_contract import Proposer
from quickdraft.spec.sampling import SamplingParams


def generate_tokens(model: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
                    eos_token_ids: frozenset[int] = frozenset(), proposer: Proposer | None = None,
                    k: int = 0, cache: KVCache | None = None, adaptive: bool = True,
                    prefix: PrefixCache | None = None) -> Iterator[TokenEvent]:
    """Tokens of one request. `cache` (batch 1, room for prompt + max_new_tokens) may be passed
    in to be inspected: after each event it holds every committed token but the newest.
    `adaptive` lets the draft-length policy verify only the part of a draft expected to pay off.
    `prefix`: the model's prefix cache, which the prompt is matched against and its tokens left to.
    The exception that ended the request (its proposer's or its pass's) is raised here."""
    context = model.config.max_position_embeddings
    check_context(len(prompt_ids), context, model.config.context_note(context))
    max_seq_len = len(prompt_ids) + min(params.max_new_tokens, context - len(prompt_ids))
    if cache is not None and (cache.batch_size != 1 or cache.max_len < max_seq_len):
        raise ValueError(f"cache needs batch 1 and room for {max_seq_len} tokens")
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=max_seq_len), cache=cache, prefix=prefix)
    request = Request(list(prompt_ids), params, eos_token_ids, proposer, k, adaptive)
    try:
        with closing(EngineService(engine).stream(request)) as events:  # closed now when our consumer stops
            for event in events:
                if event.error is not None:
                    raise event.error
                yield event
    finally:  # the engine goes with this call: its rows' blocks (in the prefix cache's pool) go back
        engine.close(blocks=cache is None)
