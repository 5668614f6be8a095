"""Draft-model proposer: a smaller model of the same vocabulary drafts k tokens autoregressively.

Its K/V live in a row of its Drafter's batched cache (drafter.py), shared by every request that
drafts with the same model: catch-up on tokens it has not seen (the prompt, less the prefix the
drafter's prefix cache holds from earlier requests, then the target's recovered or bonus token),
k draft steps (each one forward for all the drafter's rows that draft), and rollback of rejected
positions. `draft-tree` drafts the draft model's likeliest continuations as a tree instead, a
level of nodes per forward (drafter.py). The row and the last draft are the drafter's state
(draft_rows.DraftRow); the proposer holds only what is its request's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import Sequence

from quickdraft.kv.cache import BlockPool, KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import Committed, Draft, PassCost, ProposerContext, SpecConfigError, Target, register
from quickdraft.proposers.draft_vocab import draft_vocabulary
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.spec.sampling import SamplingParams

DRAFT_SEED_SALT = 0x5EED_D2AF7  # the draft's RNG must not replay the verifier's draws


class DraftModelProposer:
    def __init__(self, drafter: Drafter, prompt_ids: Sequence[int], params: SamplingParams,
                 capacity: int, width: int = 1, scope: str = "") -> None:
        """width 1: chains (sampled rows draw them from q); more: trees of the draft's likeliest
        continuations, `width` nodes run per level (draft-tree)."""
        self.group = drafter
        self.params = params
        self.capacity = capacity
        self.horizon = len(prompt_ids) + params.max_new_tokens  # drafter.Member
        self.width = width
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)  # drafter.Member: what follows was generated
        self.scope = scope  # drafter.Member: its request's prefix-cache scope
        seed = None if params.seed is None else (params.seed ^ DRAFT_SEED_SALT) % 2**63
        self.generator = SamplingParams(seed=seed).make_generator(drafter.model.device)
        self.cost: PassCost | None = None  # the next step's verification cost (drafter.py)

    @property
    def model(self) -> Transformer:
        return self.group.model

    @property
    def cache(self) -> KVCache:
        """This request's row of the drafter's cache."""
        return self.group.rows.row_cache(self)

    def propose(self, k: int) -> Draft:
        return self.group.propose([self], [k])[0]

    def commit(self, step: Committed) -> None:
        error = self.group.commit([self], [step])[0]
        if error is not None:
            raise error

    def took(self, step: Committed) -> None:
        self.cost = step.cost
        self.tokens.extend(step.tokens)


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


@dataclass(frozen=True)
class DraftOptions:
    draft_vocab: int = option(65536, "draft, draft-tree, lookup-draft: the tokens the draft model may propose: "
                                 "its N lowest ids and the special tokens (0: all; draft_vocab.py)", 0, 1 << 24)

    def __post_init__(self) -> None:
        check_ranges(self)


def _drafting(ctx: ProposerContext, width: int) -> DraftModelProposer:
    draft = ctx.target.draft_model(ctx.config.draft_model)
    # a tree's nodes run in the drafter's row past the committed tokens: width per level, k levels
    room = ctx.config.k + 1 if width == 1 else (width + 1) * ctx.config.k + 1
    capacity = min(draft.model.config.max_position_embeddings, len(ctx.prompt_ids) + ctx.params.max_new_tokens + room)
    # one Drafter per draft model (and vocabulary) for all of the target's requests: their draft steps batch
    size = ctx.options.draft_vocab
    prefix = draft_prefix(ctx.target, draft.model)  # not inside the make below: shared() is not re-entrant
    drafter = ctx.target.shared((Drafter, draft.model, size), lambda: Drafter(
        draft.model, draft_vocabulary(draft.tokenizer, draft.model.config.vocab_size, size), prefix))
    return DraftModelProposer(drafter, ctx.prompt_ids, ctx.params, capacity, width, ctx.scope)


PREFIX_SHARE = 4  # a draft's prefix cache holds at most a quarter of its target's budget (a draft's
                  # K/V per token are a fraction of its target's: the Qwen 0.5B's 0.43 of the 1.5B's)


def draft_prefix(target: Target, draft: Transformer) -> PrefixCache | None:
    """The draft model's cache of earlier requests' K/V, one for all its drafters (one per draft
    vocabulary a request may ask for: their K/V are the same), of a PREFIX_SHARE-th of its
    target's budget; none where the target keeps none (--no-prefix-cache), or where that share is
    below one of the draft's blocks (a budget of a few MiB, made to test eviction)."""
    budget = 0 if target.prefix is None else target.prefix.budget_bytes // PREFIX_SHARE
    if budget < PrefixCache.block_size(draft.config, draft.compute_dtype, feature_width=0):
        return None
    return target.shared((PrefixCache, draft), lambda: PrefixCache(
        budget, draft.config, draft.compute_dtype, feature_width=0,
        pool=BlockPool(draft.config, draft.compute_dtype, draft.device)))


@register("draft", DraftOptions, loads="draft_model", needs_file=True,
          about="a smaller model of the same vocabulary drafts token by token")
def make_draft(ctx: ProposerContext) -> DraftModelProposer:
    return _drafting(ctx, 1)


@dataclass(frozen=True)
class DraftTreeOptions(DraftOptions):
    draft_width: int = option(4, "draft-tree: nodes the draft model runs per level, and children each adds", 2, 16)


@register("draft-tree", DraftTreeOptions, loads="draft_model", needs_file=True,
          about="a draft model's likeliest continuations as a tree (EAGLE-2's dynamic tree)")
def make_draft_tree(ctx: ProposerContext) -> DraftModelProposer:
    return _drafting(ctx, ctx.options.draft_width)
