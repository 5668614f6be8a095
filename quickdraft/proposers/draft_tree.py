"""Tree drafting (EAGLE-2's dynamic tree): each tree member of a batched draft step runs its
`width` likeliest newest nodes per level, in the same forward as every other tree row, while a
level pays (draft_cost.worth).

Knows the drafter's forward and its members' settings; nothing of the engine.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from quickdraft.proposers import draft_cost
from quickdraft.proposers.draft_chain import penalized
from quickdraft.proposers.growing_tree import GrowingTree
from quickdraft.spec.draft_contract import Draft

if TYPE_CHECKING:
    from quickdraft.proposers.drafter import Drafter, Proposal


def grow(drafter: Drafter, proposal: Proposal, going: list[int], logits: torch.Tensor) -> None:
    """EAGLE-2's dynamic tree for each member of `going` (logits [len(going), V] after its
    newest token), into proposal.drafts[b] and its state's nodes and likeliest path: level by level, the `width` nodes of the newest level likeliest
    to be reached (the product of the draft's probabilities along their paths) run in one forward
    for every tree row, each adding its `width` likeliest tokens as children; a row stops when
    its newest level cannot hold one of its k likeliest nodes, or when the level's forward
    does not pay for what it is expected to add (`draft_cost.worth`, the chance that a node of the level
    is reached and accepted: a tree's one path commits at most one token per level). Its draft
    is those k nodes, likeliest first (a child is never likelier than its parent: every prefix
    is a tree, as the policy verifies prefixes). The nodes are the draft's choices, not draws: q is None, which
    the verifier's recursive rejection takes exactly for sampled rows too (a rejected sibling's
    token leaves p before the next is tried), and no drawn token decides what is verified, so
    every row's estimates may read the draft's probabilities."""
    members, states, ks, calibration = proposal.members, proposal.states, proposal.ks, proposal.calibration
    grown = {b: GrowingTree() for b in going}
    expanded = {b: [-1] for b in going}  # per row, the nodes whose children the logits give
    level_logits = {b: logits[i:i + 1] for i, b in enumerate(going)}  # [len(expanded), V]
    growing = list(going)
    for level in range(max(ks[b] for b in going)):
        run: dict[int, list[int]] = {}
        for b in growing:
            m, tree = members[b], grown[b]
            paths = [tree.path(n) for n in expanded[b]]  # penalties count each node's own path
            top_p, top_i = torch.softmax(penalized(level_logits[b], m, paths).float(), -1).topk(m.width, -1)
            newest = tree.grow(expanded[b], top_p.tolist(), top_i.tolist(), calibration[b].estimate)
            likeliest = sorted(newest, key=lambda n: -tree.reach[n])[:m.width]
            kth = sorted(tree.reach, reverse=True)[ks[b] - 1] if len(tree.reach) >= ks[b] else 0.0
            room = len(m.tokens) + len(tree.slot) + len(likeliest) <= m.capacity
            if level + 1 < ks[b] and tree.reach[likeliest[0]] > kth and room:
                run[b] = likeliest
        # a node's chance to be reached and accepted: its path's calibrated estimates (siblings
        # exclude each other, so a level's chances sum to at most one token)
        gains = [sum(grown[b].chance[n] for n in run[b]) if b in run else 0.0 for b in range(len(members))]
        growing = draft_cost.worth(list(run), members, states, gains, calibration, proposal.plan, proposal.per_token,
                                   drafter.times.tree)
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
        out = drafter.forward([states[b] for b in growing], feeds, starts, positions, visible)  # [n, W, V]
        drafter.times.observe("tree", time.perf_counter() - t0)
        for i, b in enumerate(growing):
            level_logits[b], expanded[b] = out[i, :len(run[b])], run[b]
    for b in going:
        s, tree = states[b], grown[b]
        keep, parents = tree.likeliest(ks[b])
        s.nodes = [(tree.tokens[n], p, tree.slot.get(n)) for n, p in zip(keep, parents)]
        spine = tree.spine(keep)  # calibrated as a chain is: its likeliest path
        s.offered, s.confidences = [tree.tokens[n] for n in spine], [tree.probs[n] for n in spine]
        proposal.drafts[b] = Draft([tree.tokens[n] for n in keep], None,
                          [calibration[b].estimate(tree.probs[n]) for n in keep], parents)

