"""Batched drafting with one draft model: per draft step ONE forward for every row that drafts,
whatever their lengths. The parts: the row pool (draft_rows.py: one KV cache, a row per live
member), chains (draft_chain.py), trees (draft_tree.py), when a forward pays (draft_cost.py); this
module runs a proposal through them, the catch-ups, and the batched forward itself.

A Drafter is the proposer group (draft_contract.py) of every proposer drafting with its model; it
lives as long as the model (the target's shared state), not per request. It knows the draft model
and each member's committed tokens; each member's cache row and last draft are its own (a DraftRow
of the row pool), never written to the member. Nothing of the engine or the target.

A step's rows catch up on the tokens they have not run (one or two after a verification: the
last accepted draft and the target's token), right-aligned, so every row's newest token sits in
the forward's last column: a row with less to catch up runs a cached token again (at the cost of
the padding it replaces). A longer catch-up (the prompt) runs alone first. Rows of the cache span
that do not draft run a throwaway token past everything their owner still needs.

The drafter keeps the draft's K/V of earlier requests' prefixes (a PrefixCache of K/V only): a
row's catch-up copies the longest cached prefix of its sequence in and runs only the rest (a chat
client's resent history), which is what the cost rule prices; a prompt's K/V are offered to it once
caught up, and a row's committed tokens' K/V when its member is gone (before the row is reused).

When a step is committed (`commit`: the group's call, for all its members under the lock), `keep`
finds the accepted nodes that were run (their slots) in the member's last draft and moves their K/V
into place.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch

from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers import draft_chain, draft_cost, draft_tree
from quickdraft.proposers.draft_cost import CATCH_UP, OWN_WINDOW, Calibration, ForwardTimes, Plan
from quickdraft.proposers.draft_rows import DraftRow, Member, RowPool
from quickdraft.proposers.draft_vocab import VocabHead
from quickdraft.spec.draft_contract import NO_DRAFT, Committed, Draft, attempt
from quickdraft.spec.sequences import common_prefix


@dataclass(frozen=True)
class Proposal:
    """One batched proposal: its members, their rows' state, and what each level of their drafts
    is weighed with (draft_cost.worth); the chain and tree growers write each member's draft."""
    members: Sequence[Member]
    states: Sequence[DraftRow]
    ks: Sequence[int]                    # per member, the draft tokens it may offer at most
    calibration: Sequence[Calibration]   # per member, its draft's calibration (greedy or sampled)
    plan: Plan | None                    # what verification costs the pass (None: draft ks whole)
    per_token: float
    drafts: list[Draft]                  # out: per member its draft (NO_DRAFT where it offers none)
    gains: list[float]                   # per member, the chance its next draft token is reached


class Drafter:
    def __init__(self, model: Transformer, vocab: torch.Tensor | None = None, prefix: PrefixCache | None = None) -> None:
        """vocab: the token ids the draft may propose (draft_vocab.py; None: every token);
        prefix: the draft model's cache of earlier requests' K/V (one per draft model, shared by its
        drafters of each vocabulary: draft_model.draft_prefix; None: none)."""
        self.model = model
        self.head = VocabHead(model, vocab)
        self.prefix = prefix
        self.chunk = model.invariant_rows   # tokens per catch-up forward (None: any count)
        self.caught_up = 0                   # tokens the catch-ups have run (not those the prefix cache gave)
        self.rows = RowPool(model, prefix)
        self.lock = threading.Lock()
        self.calibration = {True: Calibration(), False: Calibration()}  # greedy / sampled rows
        self.times = ForwardTimes()

    def commit(self, members: Sequence[Member], steps: Sequence[Committed]) -> list[Exception | None]:
        """Each member took its step (ProposerGroup.commit): its K/V kept (keep), then the member
        told; under the lock a proposal holds, each member's failure its own."""
        with self.lock:
            return [attempt(partial(self.keep, member, step)) for member, step in zip(members, steps, strict=True)]

    def release(self, members: Sequence[Member]) -> None:
        """The members' requests ended (ProposerGroup.release): their rows return to the pool."""
        with self.lock:
            for member in members:
                self.rows.release(member)

    def keep(self, member: Member, step: Committed) -> None:
        """The member committed step.tokens, the first step.drafted of them accepted from its last
        draft: the K/V of those draft nodes that were run move to the slots after the cached tokens
        (a tree's path; a chain's are in place already); everything after is evicted. Calibrates on
        its last draft, which is then spent; then tells the member (Member.took)."""
        state = self.rows.of(member)
        if state is not None:  # it has drafted: else nothing of it is kept
            run = state.run_path(step.tokens[:step.drafted])
            if run:
                self.rows.cache.compact(state.row, state.cached, run)
            state.cached += len(run)
            self.learn(member, state, step)
            state.nodes = []
            self.rows.settle(state)
        member.took(step)

    # -- drafting -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, members: Sequence[Member], ks: Sequence[int]) -> list[Draft]:
        """A chain of up to ks[i] tokens for each member, drawn from its own q (the draft's
        distribution after the member's sampling settings) with its own generator. A failure
        leaves every member as it was (its generator rewound; K/V written past what it keeps)."""
        with self.lock:
            self.rows.reclaim()
            states = [self.rows.of(m) or self.rows.join(m) for m in members]
            rngs = [m.generator.get_state() for m in members]
            try:
                return self._propose(members, states, ks)
            except Exception:
                for m, rng in zip(members, rngs):
                    m.generator.set_state(rng)
                raise

    def _propose(self, members: Sequence[Member], states: Sequence[DraftRow], ks: Sequence[int]) -> list[Draft]:
        ks = [max(0, min(k, m.capacity - len(m.tokens) + 1)) for m, k in zip(members, ks)]
        cost = next((m.cost for m in members if m.cost is not None), None)  # the same for every row
        plan, per_token = (None, 0.0) if cost is None else (Plan.of(cost), cost.per_token)
        calibration = [self.calibration[m.params.greedy] for m in members]
        gains = [1.0] * len(members)  # per member, the chance its next draft token is reached
        going = draft_cost.worth([b for b, k in enumerate(ks) if k > 0], members, states, gains, calibration, plan,
                                 per_token, self.times.first, first=True)
        going = [b for b in going if draft_cost.catching_up_pays(
            members[b], states[b], ks[b], calibration[b], self.times, lambda b=b: self._reusable(members[b], states[b]))]
        drafts = [NO_DRAFT] * len(members)
        for b, s in enumerate(states):
            s.idle = 0 if b in going else s.idle + 1
            s.offered, s.confidences, s.nodes = [], [], []
        if not going:
            return drafts
        for b in going:  # the prompt: alone, so the others are not padded to its length
            if len(members[b].tokens) - states[b].cached > CATCH_UP:
                self._catch_up(members[b], states[b])
        t0 = time.perf_counter()
        width = max(len(members[b].tokens) - states[b].cached for b in going)
        starts = [max(0, len(members[b].tokens) - width) for b in going]
        logits = self.forward([states[b] for b in going],
                              [members[b].tokens[s:] for b, s in zip(going, starts)], starts)  # [len(going), V]
        chains = [i for i, b in enumerate(going) if members[b].width == 1]
        trees = [i for i, b in enumerate(going) if members[b].width > 1]
        proposal = Proposal(members, states, ks, calibration, plan, per_token, drafts, gains)
        if chains:
            draft_chain.grow(self, proposal, [going[i] for i in chains], logits[chains], t0)
        if trees:
            if not chains:
                self.times.observe("first", time.perf_counter() - t0)
            draft_tree.grow(self, proposal, [going[i] for i in trees], logits[trees])
        for b in going:  # only now: a failure above leaves each member as it was, to be asked alone
            s = states[b]
            s.cached = self.rows.cache.lengths[s.row] = len(members[b].tokens)
        return drafts

    def _catch_up(self, m: Member, s: DraftRow) -> None:
        """Bring m's row up to all but its newest token, alone: the longest prefix the prefix cache
        holds past what the row has is copied in; the rest, if more than CATCH_UP, runs in forwards
        of at most `chunk` tokens (every token's K/V then bitwise those of any other split: a fresh
        catch-up's, or the row's they were stored from), and is offered to the prefix cache."""
        end = len(m.tokens) - 1
        if self._reusable(m, s) > s.cached:
            s.cached = self.prefix.fetch_kv(m.tokens, end, self.rows.cache, s.row, m.scope)
        if len(m.tokens) - s.cached > CATCH_UP:
            t0, behind = time.perf_counter(), end - s.cached
            for start in range(s.cached, end, self.chunk or behind):
                self.forward([s], [m.tokens[start:min(end, start + (self.chunk or behind))]], [start])
            self.times.observe("catch_up", (time.perf_counter() - t0) / behind)
            self.caught_up += behind
            s.cached = end
            if self.prefix is not None:
                self.prefix.store(m.tokens[:end], self.rows.cache, s.row, scope=m.scope)
        self.rows.settle(s)

    def _reusable(self, m: Member, s: DraftRow) -> int:
        """How many of m's tokens its row can hold the K/V of without running them: those it has,
        or the prefix cache's longest match (never the newest token: its logits start the draft)."""
        if self.prefix is None:
            return s.cached
        return max(s.cached, self.prefix.hit(m.tokens, len(m.tokens) - 1, m.scope))

    def learn(self, member: Member, state: DraftRow, step: Committed) -> None:
        """Calibrate on the member's last draft: a token counts as accepted where the committed
        text has it, the first that differs as rejected. For a greedy row that is exactly the
        verifier's verdict, and it judges tokens the engine chose not to verify too; a sampled
        row's text is a draw of the target's, which agrees with a draft token less often than
        verification accepts it, so there only the verified tokens count."""
        if not state.offered:
            return
        verified = min(len(state.offered), len(step.tokens))
        if not member.params.greedy:
            verified = min(verified, step.verified)
        accepted = min(common_prefix(state.offered, step.tokens), verified)
        self.calibration[member.params.greedy].record(state.confidences, verified, accepted)
        state.record.record(accepted, min(verified, accepted + 1))  # as the calibration counts them
        state.record.recent(OWN_WINDOW)
        state.offered, state.confidences = [], []  # judged once: a step it did not draft for must not judge it again

    def forward(self, states: Sequence[DraftRow], feeds: Sequence[list[int]], starts: Sequence[int],
                 positions: Sequence[list[int]] | None = None,
                 visible: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Run each row's `feeds` tokens in its slots from `starts` on, all in one forward over
        the cache rows from the lowest of `states` to the highest; -> logits [n, V] after each
        row's last fed token. Trees give each token's `positions` and `visible` [T, start + T]
        (the slots it sees); -> logits [n, width, V] after each fed token."""
        lo, hi = min(s.row for s in states), max(s.row for s in states) + 1
        span_feeds: list[list[int]] = [[0] for _ in range(lo, hi)]  # rows that do not draft: a throwaway
        span_starts = self.rows.free_from[lo:hi]                           # token where nothing is kept
        for s, feed, start in zip(states, feeds, starts):
            span_feeds[s.row - lo], span_starts[s.row - lo] = feed, start
        width = max(map(len, feeds))
        device = self.model.device
        ids = torch.tensor([f + f[-1:] * (width - len(f)) for f in span_feeds], device=device)  # [S, width]
        slots = torch.tensor(span_starts, device=device)[:, None] + torch.arange(width, device=device)
        at, mask = slots, None
        if positions is not None:  # a tree: siblings share a position, not a slot, nor see each other
            at = slots.clone()
            mask = torch.ones(hi - lo, width, int(slots.max()) + 1, dtype=torch.bool)  # [S, width, kv_len]
            for s, pos, seen in zip(states, positions, visible):
                at[s.row - lo, :len(pos)] = torch.tensor(pos, device=device)
                mask[s.row - lo, :seen.shape[0], :seen.shape[1]] = seen
            mask = mask.to(device)
        hidden = self.model(ids, at, self.rows.cache.rows(lo, hi), attn_mask=mask, last_n=0, slots=slots).hidden
        for s, feed, start in zip(states, feeds, starts):  # later forwards of this proposal keep off
            self.rows.free_from[s.row] = max(self.rows.free_from[s.row], start + len(feed))
        index = torch.tensor([s.row - lo for s in states], device=device)
        if positions is not None:
            return self.head(hidden[index])  # [n, width, V]
        last = torch.tensor([len(f) - 1 for f in feeds], device=device)
        return self.head(hidden[index, last])  # [n, V]: the head only where a draft reads it

