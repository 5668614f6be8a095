"""Draft models and drafters for the tests: a noisy copy of the target, a drafter that counts its
rows per forward, members whose draft-cache rows are checked (chains and trees), the first sampled
tokens through a batched draft (test_batched_draft's and test_draft_tree's)."""
from __future__ import annotations

from typing import Sequence

import torch
from gguf import GGMLQuantizationType

from quickdraft.engine.batch import Request
from quickdraft.proposers.base import Committed, Proposer
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.spec.sampling import SamplingParams
from support.engine import draft_state, first_tokens_in_batches
from support.laws import N_SAMPLES, PROMPT16, SAMPLE_K, SAMPLE_NEW
from support.models import KV_TOL, kv_mismatch, tiny16
from tiny_models import hf_model, ours_from_hf


def noisy_draft(seed: int = 3, noise: float = 0.15, qtype: GGMLQuantizationType | None = None):
    """The engine tests' target with noise on its weights: acceptance is mixed (with `qtype`, its
    matrices, the LM head included, as those GGUF blocks)."""
    hf = hf_model("llama-gqa-untied", initializer_range=0.1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=g) * noise * param.std())
    return ours_from_hf(hf, qtype=qtype)


class Counted(Drafter):
    """A Drafter that records how many rows drafted in each of its forwards."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows_per_forward: list[int] = []
        self.fed: list[list[tuple[int, int]]] = []  # per forward: each member's row and sequence length

    def forward(self, states, feeds, starts, *tree):
        self.rows_per_forward.append(len(states))
        self.fed.append([(s.row, len(self.rows.owners[s.row])) for s in states])  # owners: the members' tokens
        return super().forward(states, feeds, starts, *tree)


def first_tokens(drafter: Drafter, seed0: int) -> tuple[torch.Tensor, int, int]:
    """N_SAMPLES sampled requests (temperature 1) through one engine of 8 rows, every draft
    proposer a member of `drafter`, requests joining as others leave: counts [V16]*N_TOKENS of
    the first tokens; drafted and accepted tokens in all."""
    requests = []
    for seed in range(seed0, seed0 + N_SAMPLES):
        p = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=SAMPLE_NEW, ignore_eos=True)
        proposer = DraftModelProposer(drafter, PROMPT16, p, len(PROMPT16) + SAMPLE_NEW + SAMPLE_K + 1)
        requests.append(Request(PROMPT16, p, frozenset(), proposer, SAMPLE_K, id=str(seed)))
    return first_tokens_in_batches(tiny16(), requests)


class Watched(DraftModelProposer):
    """A member whose draft-cache row is checked after every commit and whose trees are counted,
    of a watched drafter (watch)."""
    log: dict[str, int]
    violations: list[str]


def watch(drafter: Drafter) -> Drafter:
    """The drafter, its commits checking each Watched member's row after keeping its step."""
    keep = drafter.keep

    def watched(member: DraftModelProposer, step: Committed) -> None:
        if not isinstance(member, Watched):
            return keep(member, step)
        # its last draft, however it was asked for (alone or in its drafter's group call): a tree
        # where a node's parent is not the node before it
        state = draft_state(member)
        member.log["trees"] += any(parent != i - 1 for i, (_, parent, _) in enumerate(state.nodes))
        before = state.cached
        keep(member, step)
        state = draft_state(member)
        member.log["kept"] += state.cached - before > 1  # K/V kept from drafted nodes, not only caught up
        seq = member.tokens[:state.cached]
        if member.cache.lengths[0] != state.cached:
            member.violations.append(f"row {state.row}: length {member.cache.lengths[0]} != {state.cached}")
        if (diff := kv_mismatch(member.model, member.cache, seq)) > KV_TOL:
            member.violations.append(f"row {state.row}: K/V of {len(seq)} tokens differ by {diff:.3g}")
    drafter.keep = watched  # type: ignore[method-assign] - this drafter's commits only
    return drafter


def members(drafter: Drafter, widths: Sequence[int], violations: list[str], log: dict[str, int]):
    """Proposers of the drafter (watched), their widths taken in turn (1: a chain)."""
    turn = iter(range(10 ** 6))
    watch(drafter)

    def make(prompt: Sequence[int], params: SamplingParams) -> Proposer:
        width = widths[next(turn) % len(widths)]
        proposer = Watched(drafter, prompt, params, len(prompt) + params.max_new_tokens + (width + 1) * 8 + 1, width)
        proposer.log, proposer.violations = log, violations
        return proposer
    return make
