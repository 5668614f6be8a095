"""Draft-model proposer: a smaller model of the same vocabulary drafts k tokens autoregressively.

It keeps its own KV cache: catch-up on tokens it has not seen (the prompt, then the target's
recovered or bonus token), k sequential draft steps, and rollback of rejected positions.
"""
from __future__ import annotations

from itertools import zip_longest
from typing import Sequence

import torch

from quickdraft.model.llama import Transformer
from quickdraft.sampling import SamplingParams, probabilities
from quickdraft.proposers.base import NO_DRAFT, Committed, Draft, ProposerContext, SpecConfigError, register

DRAFT_SEED_SALT = 0x5EED_D2AF7  # the draft's RNG must not replay the verifier's draws


class DraftModelProposer:
    def __init__(self, draft: Transformer, prompt_ids: Sequence[int], params: SamplingParams,
                 capacity: int) -> None:
        self.model = draft
        self.params = params
        self.cache = draft.new_cache(1, capacity)
        self.tokens = list(prompt_ids)
        self.cached = 0      # tokens[:cached] have K/V in the draft's cache
        self.fed_drafts = 0  # draft tokens of the last proposal whose K/V were written
        seed = None if params.seed is None else (params.seed ^ DRAFT_SEED_SALT) % 2**63
        self.generator = SamplingParams(seed=seed).make_generator(draft.device)

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        device = self.model.device
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        return self.model(ids, positions, self.cache, last_n=1).logits[:, -1]  # [1, V]

    @torch.inference_mode()
    def propose(self, k: int) -> Draft:
        k = min(k, self.cache.max_len - len(self.tokens) + 1)  # stay inside the draft's context
        if k <= 0:
            return NO_DRAFT
        logits = self._forward(self.tokens[self.cached:], self.cached)  # catch up
        self.cached = len(self.tokens)
        drafted, qs = [], []
        for i in range(k):
            if self.params.greedy:
                x = int(logits.argmax(-1))
            else:
                q = probabilities(logits, self.params)  # same processing as the target's p
                x = int(torch.multinomial(q, 1, generator=self.generator))
                qs.append(q)
            drafted.append(x)
            if i < k - 1:
                logits = self._forward([x], len(self.tokens) + i)
        self.fed_drafts = k - 1
        return Draft(drafted, None if self.params.greedy else torch.cat(qs))

    def commit(self, step: Committed) -> None:
        # After a proposal `cached` == len(tokens) (before the first it is 0: nothing was run yet).
        # Accepted drafts that were fed keep their K/V; everything after is evicted.
        self.cached += min(step.drafted, self.fed_drafts)
        self.cache.truncate([self.cached])
        self.tokens.extend(step.tokens)
        self.fed_drafts = 0


def check_compatible(target, draft) -> None:
    """Same vocabulary size and the same token strings: otherwise p and q speak of different tokens."""
    if target.model.device != draft.model.device:
        raise SpecConfigError(f"the draft model is on {draft.model.device} but the target is on "
                              f"{target.model.device}; load both on the same device")
    tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
    if tv != dv:
        raise SpecConfigError(f"draft vocabulary has {dv} entries but the target's has {tv}; "
                              f"a draft model must share the target's tokenizer")
    t_tokens, d_tokens = target.tokenizer.token_strings(), draft.tokenizer.token_strings()
    for i, (a, b) in enumerate(zip_longest(t_tokens, d_tokens)):
        if a != b:
            raise SpecConfigError(f"draft and target tokenizers differ: token {i} is {b!r} in the "
                                  f"draft but {a!r} in the target")


@register("draft", loads="draft_model", needs_file=True,
          about="a smaller model of the same vocabulary drafts token by token")
def make_draft(ctx: ProposerContext) -> DraftModelProposer:
    draft = ctx.target.draft_model(ctx.config.draft_model)
    capacity = min(draft.model.config.max_position_embeddings,
                   len(ctx.prompt_ids) + ctx.params.max_new_tokens + ctx.config.k + 1)
    return DraftModelProposer(draft.model, ctx.prompt_ids, ctx.params, capacity)
