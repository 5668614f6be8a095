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

The drafter keeps the draft's K/V of earlier requests' prefixes (a PrefixCache of K/V only): a
row's catch-up copies the longest cached prefix of its sequence in and runs only the rest (a chat
client's resent history), which is what the cost rule prices; a prompt's K/V are offered to it once
caught up, and a row's committed tokens' K/V when its member is gone (before the row is reused).

A member of width > 1 drafts a tree (EAGLE-2's dynamic tree, `_trees`): each level runs its
`width` likeliest newest nodes in the same batched forward as every other tree row, each node at
its depth's position, in a slot of its own, seeing the committed tokens and its ancestors. When a
step is committed, the accepted nodes that were run keep their K/V, moved into place (`keep`).
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
from quickdraft.prefix_cache import PrefixCache
from quickdraft.draft_contract import NO_DRAFT, Draft, PassCost
from quickdraft.proposers.draft_cost import EXPLORE, Calibration, ForwardTimes, Plan, catch_up_pays
from quickdraft.proposers.draft_vocab import VocabHead
from quickdraft.proposers.growing_tree import GrowingTree
from quickdraft.sampling import SamplingParams, penalize, probabilities, sample
from quickdraft.sequences import common_prefix

CATCH_UP = 4  # tokens a row may catch up on inside the batched forward; more run alone first


class Member(Protocol):
    """What the drafter reads and keeps of a proposer drafting with it (draft_model.py)."""
    row: int | None           # its row of the drafter's cache (None: not drafted yet)
    tokens: list[int]         # the committed sequence
    prompt_len: int           # tokens[prompt_len:] were generated (what penalties count)
    cached: int               # tokens[:cached] have K/V in its row
    width: int                # 1: it drafts chains; more: trees, running this many nodes per level
    capacity: int             # slots it may use
    horizon: int              # the sequence length at which its request ends at the latest
    params: SamplingParams
    generator: torch.Generator
    cost: PassCost | None     # what verification costs in the next step (None: draft ks whole)
    idle: int                 # proposals in a row it drafted nothing for
    offered: list[int]        # its last draft's tokens (a tree's: its likeliest path)
    confidences: list[float]  # the draft's probability of each of them
    nodes: list[tuple[int, int, int | None]]  # its last draft's nodes: token, parent (-1: the root),
                                              # the cache slot of its K/V (None: it was not run)


def _explores(m: Member) -> bool:
    """Whether the member drafts on the hope of the best acceptance measured: after EXPLORE idle
    steps, once the draft has its prompt (a prompt is prefilled only where drafting pays by the
    mean: explorations that prefilled chat prompts cost a server with the Qwen pair 3% at one
    request at a time, and found nothing to draft)."""
    return m.idle >= EXPLORE and m.cached > 0


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
        self.cache: KVCache | None = None
        self.taken: list[bool] = []          # per cache row: a live member owns it
        self.owners: list[list[int]] = []    # per cache row: its member's committed tokens (the member's
                                             # own list, read for the prefix cache once the member is gone)
        self.free_from: list[int] = []       # per cache row: the first slot its owner does not need
        self.released: deque[int] = deque()  # rows of members gone (appended from any thread)
        self.lock = threading.Lock()
        self.collect_at = 1  # pool size from which a full garbage collection may run again
        self.longest, self.slack = 0, CATCH_UP  # the cache's length: the largest capacity + the widest forward
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
        # past every member's capacity, room for the throwaway tokens a row runs while others draft:
        # as wide as the widest forward (a catch-up, or a tree level)
        self.slack = max(self.slack, member.width)
        self.longest = max(self.longest, member.capacity)
        max_len = max(self.longest + self.slack, 0 if self.cache is None else self.cache.max_len)
        if self.cache is None or rows > self.cache.batch_size or max_len > self.cache.max_len:
            self._grow(rows, max_len)
        self.taken += [False] * (rows - len(self.taken))
        self.owners += [[] for _ in range(rows - len(self.owners))]
        self.free_from += [0] * (rows - len(self.free_from))
        self.taken[row], self.owners[row], self.free_from[row] = True, member.tokens, 0
        self.cache.lengths[row] = 0
        member.row = row
        weakref.finalize(member, self.released.append, row)

    def _reclaim(self) -> None:
        """Free the rows of members gone, first offering the K/V of their committed tokens to the
        prefix cache (here, on the drafter's thread: a member's finalizer may run on any)."""
        while self.released:
            row = self.released.popleft()
            if self.prefix is not None:
                self.prefix.store(self.owners[row][:self.cache.lengths[row]], self.cache, row)
            self.taken[row], self.owners[row], self.free_from[row] = False, [], 0
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

    def keep(self, member: Member, tokens: Sequence[int], drafted: int) -> None:
        """The member committed `tokens`, the first `drafted` of them its last draft's nodes: the
        accepted nodes that were run keep their K/V, moved to the slots after the committed ones (a
        tree's path; a chain's is in place already); everything after is evicted."""
        run, parent = [], -1
        for token in tokens[:drafted]:
            parent = next((n for n, (t, p, _) in enumerate(member.nodes) if p == parent and t == token), None)
            if parent is None or member.nodes[parent][2] is None:
                break
            run.append(member.nodes[parent][2])
        if run:
            self.cache.compact(member.row, member.cached, run)
        member.cached += len(run)
        member.tokens.extend(tokens)
        member.nodes = []
        self.learn(member, tokens)
        if member.row is not None:
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
        going = [b for b in going if self._catching_up_pays(members[b], ks[b], calibration[b])]
        drafts = [NO_DRAFT] * len(members)
        for b, m in enumerate(members):
            m.idle = 0 if b in going else m.idle + 1
            m.offered, m.confidences, m.nodes = [], [], []
        if not going:
            return drafts
        for b in going:  # the prompt: alone, so the others are not padded to its length
            if len(members[b].tokens) - members[b].cached > CATCH_UP:
                self._catch_up(members[b])
        t0 = time.perf_counter()
        width = max(len(members[b].tokens) - members[b].cached for b in going)
        starts = [max(0, len(members[b].tokens) - width) for b in going]
        logits = self._forward([members[b] for b in going],
                               [members[b].tokens[s:] for b, s in zip(going, starts)], starts)  # [len(going), V]
        chains = [i for i, b in enumerate(going) if members[b].width == 1]
        trees = [i for i, b in enumerate(going) if members[b].width > 1]
        if chains:
            self._chains(members, [going[i] for i in chains], ks, logits[chains], t0, drafts, gains, calibration,
                         plan, per_token)
        if trees:
            if not chains:
                self.times.observe("first", time.perf_counter() - t0)
            self._trees(members, [going[i] for i in trees], ks, logits[trees], drafts, calibration, plan, per_token)
        for b in going:  # only now: a failure above leaves each member as it was, to be asked alone
            m = members[b]
            m.cached = self.cache.lengths[m.row] = len(m.tokens)
        return drafts

    def _chains(self, members: Sequence[Member], going: list[int], ks: Sequence[int], logits: torch.Tensor, t0: float,
                drafts: list[Draft], gains: list[float], calibration: Sequence[Calibration], plan: Plan | None,
                per_token: float) -> None:
        """A chain for each member of `going` (logits [len(going), V] after its newest token), drawn
        from its q, one level per forward while a level pays (_worth), into drafts[b]."""
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
            self.times.observe("first" if i == 0 else "later", time.perf_counter() - t0)
            drafting = self._worth([b for b in drafting if ks[b] > i + 1], members, gains, calibration, plan,
                                   per_token, self.times.later)
            if not drafting:
                break
            t0 = time.perf_counter()
            logits = self._forward([members[b] for b in drafting], [[members[b].offered[-1]] for b in drafting],
                                   [len(members[b].tokens) + i for b in drafting])
        for b in going:
            m = members[b]
            n = len(m.offered)  # every token but the last was fed, each in the slot after its parent's
            m.nodes = [(x, i - 1, len(m.tokens) + i if i < n - 1 else None) for i, x in enumerate(m.offered)]
            drafts[b] = Draft(list(m.offered), None if m.params.greedy else torch.cat(qs[b]), estimates[b])

    def _trees(self, members: Sequence[Member], going: list[int], ks: Sequence[int], logits: torch.Tensor,
               drafts: list[Draft], calibration: Sequence[Calibration], plan: Plan | None, per_token: float) -> None:
        """EAGLE-2's dynamic tree for each member of `going` (logits [len(going), V] after its
        newest token), into drafts[b]: level by level, the `width` nodes of the newest level likeliest
        to be reached (the product of the draft's probabilities along their paths) run in one forward
        for every tree row, each adding its `width` likeliest tokens as children; a row stops when
        its newest level cannot hold one of its k likeliest nodes, or when the level's forward
        does not pay for what it is expected to add (`_worth`, the chance that a node of the level
        is reached and accepted: a tree's one path commits at most one token per level). Its draft
        is those k nodes, likeliest first (a child is never likelier than its parent: every prefix
        is a tree, as the policy verifies prefixes). The nodes are the draft's choices, not draws: q is None, which
        the verifier's recursive rejection takes exactly for sampled rows too (a rejected sibling's
        token leaves p before the next is tried), and no drawn token decides what is verified, so
        every row's estimates may read the draft's probabilities."""
        grown = {b: GrowingTree() for b in going}
        expanded = {b: [-1] for b in going}  # per row, the nodes whose children the logits give
        level_logits = {b: logits[i:i + 1] for i, b in enumerate(going)}  # [len(expanded), V]
        growing = list(going)
        for level in range(max(ks[b] for b in going)):
            run: dict[int, list[int]] = {}
            for b in growing:
                m, tree = members[b], grown[b]
                paths = [tree.path(n) for n in expanded[b]]  # penalties count each node's own path
                top_p, top_i = torch.softmax(_penalized(level_logits[b], m, paths).float(), -1).topk(m.width, -1)
                newest = tree.grow(expanded[b], top_p.tolist(), top_i.tolist(), calibration[b].estimate)
                likeliest = sorted(newest, key=lambda n: -tree.reach[n])[:m.width]
                kth = sorted(tree.reach, reverse=True)[ks[b] - 1] if len(tree.reach) >= ks[b] else 0.0
                room = len(m.tokens) + len(tree.slot) + len(likeliest) <= m.capacity
                if level + 1 < ks[b] and tree.reach[likeliest[0]] > kth and room:
                    run[b] = likeliest
            # a node's chance to be reached and accepted: its path's calibrated estimates (siblings
            # exclude each other, so a level's chances sum to at most one token)
            gains = [sum(grown[b].chance[n] for n in run[b]) if b in run else 0.0 for b in range(len(members))]
            growing = self._worth(list(run), members, gains, calibration, plan, per_token, self.times.tree)
            if not growing:
                break
            t0 = time.perf_counter()
            feeds, starts, positions, visible = [], [], [], []
            for b in growing:
                m, tree = members[b], grown[b]
                start = len(m.tokens) + len(tree.slot)
                tree.slot.update({n: start + j for j, n in enumerate(run[b])})
                feeds.append([tree.tokens[n] for n in run[b]])
                starts.append(start)
                positions.append([len(m.tokens) - 1 + tree.depth[n] for n in run[b]])  # the root: the newest token
                visible.append(tree.visible(run[b], len(m.tokens)))
            out = self._forward([members[b] for b in growing], feeds, starts, positions, visible)  # [n, W, V]
            self.times.observe("tree", time.perf_counter() - t0)
            for i, b in enumerate(growing):
                level_logits[b], expanded[b] = out[i, :len(run[b])], run[b]
        for b in going:
            m, tree = members[b], grown[b]
            keep, parents = tree.likeliest(ks[b])
            m.nodes = [(tree.tokens[n], p, tree.slot.get(n)) for n, p in zip(keep, parents)]
            spine = tree.spine(keep)  # calibrated as a chain is: its likeliest path
            m.offered, m.confidences = [tree.tokens[n] for n in spine], [tree.probs[n] for n in spine]
            drafts[b] = Draft([tree.tokens[n] for n in keep], None,
                              [calibration[b].estimate(tree.probs[n]) for n in keep], parents)

    def _catch_up(self, m: Member) -> None:
        """Bring m's row up to all but its newest token, alone: the longest prefix the prefix cache
        holds past what the row has is copied in; the rest, if more than CATCH_UP, runs in forwards
        of at most `chunk` tokens (every token's K/V then bitwise those of any other split: a fresh
        catch-up's, or the row's they were stored from), and is offered to the prefix cache."""
        end = len(m.tokens) - 1
        if self._reusable(m) > m.cached:
            m.cached = self.prefix.fetch_kv(m.tokens, end, self.cache, m.row)
        if len(m.tokens) - m.cached > CATCH_UP:
            t0, behind = time.perf_counter(), end - m.cached
            for start in range(m.cached, end, self.chunk or behind):
                self._forward([m], [m.tokens[start:min(end, start + (self.chunk or behind))]], [start])
            self.times.observe("catch_up", (time.perf_counter() - t0) / behind)
            self.caught_up += behind
            m.cached = end
            if self.prefix is not None:
                self.prefix.store(m.tokens[:end], self.cache, m.row)
        self.cache.lengths[m.row] = self.free_from[m.row] = m.cached

    def _reusable(self, m: Member) -> int:
        """How many of m's tokens its row can hold the K/V of without running them: those it has,
        or the prefix cache's longest match (never the newest token: its logits start the draft)."""
        if self.prefix is None:
            return m.cached
        return max(m.cached, self.prefix.hit(m.tokens, len(m.tokens) - 1))

    def _catching_up_pays(self, m: Member, k: int, calibration: Calibration) -> bool:
        """A row behind by more than CATCH_UP tokens (its prompt, or text committed while it did
        not draft) drafts only if drafting can repay the catch-up over the rest of its request
        (catch_up_pays) at the acceptance that let it draft: the mean, or for a row exploring the
        best measured (_explores). The catch-up is what the prefix cache cannot give (a resent
        chat history: the new turn). Rows whose lengths must not depend on timing, and rows before
        anything is timed, always do."""
        if len(m.tokens) - m.cached <= CATCH_UP or m.cost is None or None in (self.times.catch_up, self.times.first):
            return True
        behind = len(m.tokens) - self._reusable(m)
        later = self.times.later if self.times.later is not None else self.times.first
        acceptance = calibration.best if _explores(m) else calibration.mean
        return catch_up_pays(m.cost, acceptance, k, self.times.first, later, m.horizon - len(m.tokens),
                             self.times.catch_up * behind)

    @staticmethod
    def _worth(rows: list[int], members: Sequence[Member], gains: list[float], calibration: Sequence[Calibration],
               plan: Plan | None, per_token: float, level_s: float | None, first: bool = False) -> list[int]:
        """Which of `rows` draft one more token (draft_cost.py): all of them while their lengths
        must not depend on timing (no plan); while the level's cost is not measured yet, those that
        cannot choose, or else one; then the rows that cannot choose (a pass cost of None), rows
        exploring (_explores) where a level could pay at the best acceptance measured (where none
        could, as on a CPU whose verification of k tokens costs k passes, exploring is a loss: its
        catch-up forward is not repaid), and those of the others whose expected gains pay for the
        level."""
        if plan is None:
            return rows
        if level_s is None:  # rows that cannot choose draft; else one row measures the level first,
            # the one with least to catch up: a server's first wave would otherwise prefill every
            # prompt in the draft, for drafts that may not pay at its batch size
            must = [b for b in rows if members[b].cost is None]
            return must or sorted(rows, key=lambda b: len(members[b].tokens) - members[b].cached)[:1]
        forced = [b for b in rows if members[b].cost is None
                  or (first and _explores(members[b]) and plan.pays(calibration[b].best, level_s, per_token))]
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
        self.calibration[member.params.greedy].record(member.confidences, min(len(member.offered), len(committed)),
                                                      common_prefix(member.offered, committed))
        member.offered, member.confidences = [], []  # judged once: a step it did not draft for must not judge it again

    @staticmethod
    def _draw(logits: torch.Tensor, members: Sequence[Member], qs: Sequence[list[torch.Tensor]]) -> list[tuple[int, float]]:
        """logits [n, V] -> per member a token and the draft's probability of it: the argmax for
        greedy members, else a draw from q = probabilities(logits) (the target's processing), appended
        to its qs; a member's penalties count its generated tokens and its chain drafted so far, as
        the verifier's count them at that position."""
        confidence, best = torch.softmax(logits.float(), -1).max(-1)
        best, confidence = best.tolist(), confidence.tolist()  # one host sync for the greedy rows
        out = []
        for j, (m, q_list) in enumerate(zip(members, qs)):
            row = _penalized(logits[j:j + 1], m, [m.offered])  # [1, V]
            if m.params.greedy:
                top, x = torch.softmax(row.float(), -1).max(-1) if m.params.penalized else (confidence[j], best[j])
                out.append((int(x), float(top)))
                continue
            q = probabilities(row, m.params)  # [1, V]
            q_list.append(q)
            x = int(sample(q, m.generator))
            out.append((x, float(q[0, x])))
        return out

    def _forward(self, members: Sequence[Member], feeds: Sequence[list[int]], starts: Sequence[int],
                 positions: Sequence[list[int]] | None = None,
                 visible: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Run each member's `feeds` tokens in its slots from `starts` on, all in one forward over
        the cache rows from the lowest member's to the highest's; -> logits [n, V] after each
        member's last fed token. Trees give each token's `positions` and `visible` [T, start + T]
        (the slots it sees); -> logits [n, width, V] after each fed token."""
        lo, hi = min(m.row for m in members), max(m.row for m in members) + 1
        span_feeds: list[list[int]] = [[0] for _ in range(lo, hi)]  # rows that do not draft: a throwaway
        span_starts = self.free_from[lo:hi]                           # token where nothing is kept
        for m, feed, start in zip(members, feeds, starts):
            span_feeds[m.row - lo], span_starts[m.row - lo] = feed, start
        width = max(map(len, feeds))
        device = self.model.device
        ids = torch.tensor([f + f[-1:] * (width - len(f)) for f in span_feeds], device=device)  # [S, width]
        slots = torch.tensor(span_starts, device=device)[:, None] + torch.arange(width, device=device)
        at, mask = slots, None
        if positions is not None:  # a tree: siblings share a position, not a slot, nor see each other
            at = slots.clone()
            mask = torch.ones(hi - lo, width, int(slots.max()) + 1, dtype=torch.bool)  # [S, width, kv_len]
            for m, pos, seen in zip(members, positions, visible):
                at[m.row - lo, :len(pos)] = torch.tensor(pos, device=device)
                mask[m.row - lo, :seen.shape[0], :seen.shape[1]] = seen
            mask = mask.to(device)
        hidden = self.model(ids, at, self.cache.rows(lo, hi), attn_mask=mask, last_n=0, slots=slots).hidden
        for m, feed, start in zip(members, feeds, starts):  # later forwards of this proposal keep off
            self.free_from[m.row] = max(self.free_from[m.row], start + len(feed))
        index = torch.tensor([m.row - lo for m in members], device=device)
        if positions is not None:
            return self.head(hidden[index])  # [n, width, V]
        last = torch.tensor([len(f) - 1 for f in feeds], device=device)
        return self.head(hidden[index, last])  # [n, V]: the head only where a draft reads it


def _penalized(logits: torch.Tensor, m: Member, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [E, V] after each of `paths` (the draft's tokens from the root) less m's presence and
    frequency penalties, counted as the verifier counts them there: the generated tokens and the
    path (verify.py); as they are where m has none."""
    return penalize(logits, m.params, m.tokens[m.prompt_len:], paths) if m.params.penalized else logits
