"""Batched drafting with one draft model: one KV cache with a row per live draft-model proposer,
and per draft step ONE forward for every row that drafts, whatever their lengths.

A Drafter is the proposer group (proposers/base.py) of every proposer drafting with its model; it
lives as long as the model (the target's shared state), not per request. It knows the draft model
and each member's committed tokens and cache row, nothing of the engine or the target.

A step's rows catch up on the tokens they have not run (one or two after a verification: the
last accepted draft and the target's token), right-aligned, so every row's newest token sits in
the forward's last column: a row with less to catch up runs a cached token again (at the cost of
the padding it replaces). A longer catch-up (the prompt) runs alone first. Rows of the cache span
that do not draft run a throwaway token past everything their owner still needs.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import deque
from typing import Protocol, Sequence

import torch

from quickdraft.cache import KVCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import NO_DRAFT, Draft, PassCost
from quickdraft.proposers.draft_cost import EXPLORE, Calibration, ForwardTimes, Plan
from quickdraft.sampling import SamplingParams, probabilities, sample

CATCH_UP = 4  # tokens a row may catch up on inside the batched forward; more run alone first


class Member(Protocol):
    """What the drafter reads and keeps of a proposer drafting with it (draft_model.py)."""
    row: int | None           # its row of the drafter's cache (None: not drafted yet)
    tokens: list[int]         # the committed sequence
    cached: int               # tokens[:cached] have K/V in its row
    fed_drafts: int           # drafts of its last proposal whose K/V follow the cached ones
    capacity: int             # slots it may use
    params: SamplingParams
    generator: torch.Generator
    cost: PassCost | None     # what verification costs in the next step (None: draft ks whole)
    idle: int                 # proposals in a row it drafted nothing for
    offered: list[int]        # its last draft's tokens
    confidences: list[float]  # the draft's probability of each of them


class Drafter:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.taken: list[bool] = []          # per cache row: a live member owns it
        self.free_from: list[int] = []       # per cache row: the first slot its owner does not need
        self.released: deque[int] = deque()  # rows of members gone (appended from any thread)
        self.lock = threading.Lock()
        self.collect_at = 1  # pool size from which a full garbage collection may run again
        self.calibration = {True: Calibration(), False: Calibration()}  # greedy / sampled rows
        self.times = ForwardTimes()

    # -- members joining and leaving ----------------------------------------------------------------

    def _join(self, member: Member) -> None:
        """A cache row for a member drafting for the first time (not before: a waiting request
        holds none); it returns to the pool when the member is garbage."""
        if all(self.taken) and len(self.taken) >= self.collect_at:
            # a member in a reference cycle is freed only by the collector; a full collection costs
            # 0.1-1 s in a large process (it was 98% of a test suite's time, run on every join), so
            # it runs once per doubling of the pool: unreachable members hold at most half of it
            gc.collect()
            self._reclaim()
            self.collect_at = 2 * len(self.taken)
        row = self.taken.index(False) if False in self.taken else len(self.taken)
        rows = max(row + 1, len(self.taken))
        max_len = max(member.capacity + CATCH_UP, 0 if self.cache is None else self.cache.max_len)
        if self.cache is None or rows > self.cache.batch_size or max_len > self.cache.max_len:
            self._grow(rows, max_len)
        self.taken += [False] * (rows - len(self.taken))
        self.free_from += [0] * (rows - len(self.free_from))
        self.taken[row], self.free_from[row] = True, 0
        self.cache.lengths[row] = 0
        member.row = row
        weakref.finalize(member, self.released.append, row)

    def _reclaim(self) -> None:
        while self.released:
            row = self.released.popleft()
            self.taken[row], self.free_from[row] = False, 0
            self.cache.lengths[row] = 0

    def _grow(self, rows: int, max_len: int) -> None:
        """A larger cache holding what the old one held (members join rarely: a copy is cheap)."""
        new = self.model.new_cache(rows, max_len)
        if self.cache is not None:
            old = self.cache
            for a, b in zip(new.k + new.v, old.k + old.v):
                a[:old.batch_size, :, :old.max_len] = b
            new.lengths[:old.batch_size] = old.lengths
        self.cache = new

    def settle(self, member: Member) -> None:
        """The member committed a step: its row keeps K/V of tokens[:cached] and nothing more."""
        if member.row is None:
            return
        self.cache.lengths[member.row] = member.cached
        self.free_from[member.row] = member.cached

    def row_cache(self, member: Member) -> KVCache:
        """The member's row as a cache of its own (a view: tests read it); empty before its first draft."""
        if member.row is None:
            return self.model.new_cache(1, 1)
        return self.cache.rows(member.row, member.row + 1)

    # -- drafting -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, members: Sequence[Member], ks: Sequence[int]) -> list[Draft]:
        """A chain of up to ks[i] tokens for each member, drawn from its own q (the draft's
        distribution after the member's sampling settings) with its own generator. A failure
        leaves every member as it was (its generator rewound; K/V written past what it keeps)."""
        with self.lock:
            self._reclaim()
            for m in members:
                if m.row is None:
                    self._join(m)
            states = [m.generator.get_state() for m in members]
            try:
                return self._propose(members, ks)
            except Exception:
                for m, state in zip(members, states):
                    m.generator.set_state(state)
                raise

    def _propose(self, members: Sequence[Member], ks: Sequence[int]) -> list[Draft]:
        ks = [max(0, min(k, m.capacity - len(m.tokens) + 1)) for m, k in zip(members, ks)]
        cost = next((m.cost for m in members if m.cost is not None), None)  # the same for every row
        plan, per_token = (None, 0.0) if cost is None else (Plan.of(cost), cost.per_token)
        calibration = [self.calibration[m.params.greedy] for m in members]
        gains = [1.0] * len(members)  # per member, the chance its next draft token is reached
        going = self._worth([b for b, k in enumerate(ks) if k > 0], members, gains, calibration, plan,
                            per_token, self.times.first, first=True)
        drafts = [NO_DRAFT] * len(members)
        for b, m in enumerate(members):
            m.idle = 0 if b in going else m.idle + 1
            m.offered, m.confidences = [], []
        if not going:
            return drafts
        for b in going:  # the prompt: alone, so the others are not padded to its length
            m = members[b]
            if len(m.tokens) - m.cached > CATCH_UP:
                self._forward([m], [m.tokens[m.cached:-1]], [m.cached])
                m.cached = len(m.tokens) - 1
                self.settle(m)
        t0 = time.perf_counter()
        width = max(len(members[b].tokens) - members[b].cached for b in going)
        starts = [max(0, len(members[b].tokens) - width) for b in going]
        logits = self._forward([members[b] for b in going],
                               [members[b].tokens[s:] for b, s in zip(going, starts)], starts)
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in going}
        estimates: dict[int, list[float]] = {b: [] for b in going}
        drafting = list(going)
        for i in range(max(ks)):
            for b, (x, confidence) in zip(drafting, self._draw(logits, [members[b] for b in drafting],
                                                              [qs[b] for b in drafting])):
                members[b].offered.append(x)
                members[b].confidences.append(confidence)
                # a sampled row's estimate must not depend on its drawn token: a prefix verified, a
                # chain cut short or a hybrid's choice made by it would keep a token for its own
                # q(x) and bias the law; greedy rows are exact whatever is verified
                estimates[b].append(calibration[b].estimate(confidence) if members[b].params.greedy
                                    else calibration[b].mean)
                gains[b] *= estimates[b][-1]
            self.times.observe(i == 0, time.perf_counter() - t0)
            drafting = self._worth([b for b in drafting if ks[b] > i + 1], members, gains, calibration, plan,
                                   per_token, self.times.later)
            if not drafting:
                break
            t0 = time.perf_counter()
            logits = self._forward([members[b] for b in drafting], [[members[b].offered[-1]] for b in drafting],
                                   [len(members[b].tokens) + i for b in drafting])
        for b in going:
            m = members[b]
            m.cached, m.fed_drafts = len(m.tokens), len(m.offered) - 1
            self.cache.lengths[m.row] = m.cached
            self.free_from[m.row] = m.cached + m.fed_drafts
            drafts[b] = Draft(list(m.offered), None if m.params.greedy else torch.cat(qs[b]), estimates[b])
        return drafts

    @staticmethod
    def _worth(rows: list[int], members: Sequence[Member], gains: list[float], calibration: Sequence[Calibration],
               plan: Plan | None, per_token: float, level_s: float | None, first: bool = False) -> list[int]:
        """Which of `rows` draft one more token (draft_cost.py): all of them while their lengths
        must not depend on timing (no plan) or the level's cost is not measured yet; else the rows
        that cannot choose (a pass cost of None), rows exploring after EXPLORE idle steps where a
        level could pay at the best acceptance measured (where none could, as on a CPU whose
        verification of k tokens costs k passes, exploring is a loss: its catch-up forward and the
        prompt's prefill are not repaid), and those of the others whose expected gains pay for the
        level."""
        if plan is None or level_s is None:
            return rows
        forced = [b for b in rows if members[b].cost is None
                  or (first and members[b].idle >= EXPLORE and plan.pays(calibration[b].best, level_s, per_token))]
        # the next token's chance: reached (gains) and accepted at a confidence not known before it is drawn
        chance = {b: gains[b] * calibration[b].mean for b in rows}
        optional = sorted((b for b in rows if b not in forced), key=lambda b: -chance[b])
        n = plan.extend([chance[b] for b in forced], [chance[b] for b in optional], level_s, per_token)
        return sorted(forced + optional[:n])

    def learn(self, member: Member, committed: Sequence[int]) -> None:
        """Calibrate on the member's last draft: a token counts as accepted where the committed
        text has it (for a greedy row exactly the verifier's verdict; also judges tokens the
        engine chose not to verify), the first that differs as rejected."""
        if not member.offered:
            return
        accepted = 0
        for drafted, token in zip(member.offered, committed):
            if drafted != token:
                break
            accepted += 1
        self.calibration[member.params.greedy].record(member.confidences, min(len(member.offered), len(committed)),
                                                      accepted)
        member.offered, member.confidences = [], []  # judged once: a step it did not draft for must not judge it again

    @staticmethod
    def _draw(logits: torch.Tensor, members: Sequence[Member], qs: Sequence[list[torch.Tensor]]) -> list[tuple[int, float]]:
        """logits [n, V] -> per member a token and the draft's probability of it: the argmax for
        greedy members, else a draw from q = probabilities(logits) (the target's processing),
        appended to its qs."""
        confidence, best = torch.softmax(logits.float(), -1).max(-1)
        best, confidence = best.tolist(), confidence.tolist()  # one host sync for the greedy rows
        out = []
        for j, (m, q_list) in enumerate(zip(members, qs)):
            if m.params.greedy:
                out.append((best[j], confidence[j]))
                continue
            q = probabilities(logits[j:j + 1], m.params)  # [1, V]
            q_list.append(q)
            x = int(sample(q, m.generator))
            out.append((x, float(q[0, x])))
        return out

    def _forward(self, members: Sequence[Member], feeds: Sequence[list[int]], starts: Sequence[int]) -> torch.Tensor:
        """Run each member's `feeds` tokens from slot `starts` on, all in one forward over the
        cache rows from the lowest member's to the highest's; -> logits [n, V] after each
        member's last fed token."""
        lo, hi = min(m.row for m in members), max(m.row for m in members) + 1
        span_feeds: list[list[int]] = [[0] for _ in range(lo, hi)]  # rows that do not draft: a throwaway
        span_starts = self.free_from[lo:hi]                           # token where nothing is kept
        for m, feed, start in zip(members, feeds, starts):
            span_feeds[m.row - lo], span_starts[m.row - lo] = feed, start
        width = max(map(len, feeds))
        device = self.model.device
        ids = torch.tensor([f + f[-1:] * (width - len(f)) for f in span_feeds], device=device)  # [S, width]
        positions = torch.tensor(span_starts, device=device)[:, None] + torch.arange(width, device=device)
        aligned = all(len(f) == width for f in feeds)
        out = self.model(ids, positions, self.cache.rows(lo, hi), last_n=1 if aligned else None)
        for m, feed, start in zip(members, feeds, starts):  # later forwards of this proposal keep off
            self.free_from[m.row] = max(self.free_from[m.row], start + len(feed))
        index = torch.tensor([m.row - lo for m in members], device=device)
        last = torch.tensor([-1 if aligned else len(f) - 1 for f in feeds], device=device)
        return out.logits[index, last]  # [n, V]
