"""Chain drafting: each member of a batched draft step draws a chain from its own q, one level per
forward for every row still drafting, while a level pays (draft_cost.worth).

Knows the drafter's forward and its members' sampling settings; nothing of the engine.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from quickdraft.proposers import draft_cost
from quickdraft.proposers.draft_rows import Member
from quickdraft.spec.draft_contract import Draft
from quickdraft.spec.sampling import penalize, probabilities, sample

if TYPE_CHECKING:
    from quickdraft.proposers.drafter import Drafter, Proposal


def grow(drafter: Drafter, proposal: Proposal, going: list[int], logits: torch.Tensor, t0: float) -> None:
    """A chain for each member b of `going` (logits [len(going), V] after its newest token; t0: when
    their forward began), drawn from its q, one level per forward while a level pays
    (draft_cost.worth), into proposal.drafts[b] and its state's offered tokens, confidences and nodes."""
    members, states, ks, calibration = proposal.members, proposal.states, proposal.ks, proposal.calibration
    gains = proposal.gains
    qs: dict[int, list[torch.Tensor]] = {b: [] for b in going}
    estimates: dict[int, list[float]] = {b: [] for b in going}
    drafting = list(going)
    for i in range(max(ks)):
        for b, (x, confidence) in zip(drafting, draw(logits, [members[b] for b in drafting],
                                                     [states[b].offered for b in drafting],
                                                     [qs[b] for b in drafting])):
            states[b].offered.append(x)
            states[b].confidences.append(confidence)
            # a sampled row's estimate must not depend on its drawn token: a prefix verified, a
            # chain cut short or a hybrid's choice made by it would keep a token for its own
            # q(x) and bias the law; greedy rows are exact whatever is verified
            estimates[b].append(calibration[b].estimate(confidence) if members[b].params.greedy
                                else draft_cost.expected(calibration[b], states[b]))
            gains[b] *= estimates[b][-1]
        drafter.times.observe("first" if i == 0 else "later", time.perf_counter() - t0)
        drafting = draft_cost.worth([b for b in drafting if ks[b] > i + 1], members, states, gains, calibration,
                                    proposal.plan, proposal.per_token, drafter.times.later)
        if not drafting:
            break
        t0 = time.perf_counter()
        logits = drafter.forward([states[b] for b in drafting], [[states[b].offered[-1]] for b in drafting],
                                 [len(members[b].tokens) + i for b in drafting])
    for b in going:
        m, s = members[b], states[b]
        n = len(s.offered)  # every token but the last was fed, each in the slot after its parent's
        s.nodes = [(x, i - 1, len(m.tokens) + i if i < n - 1 else None) for i, x in enumerate(s.offered)]
        proposal.drafts[b] = Draft(list(s.offered), None if m.params.greedy else torch.cat(qs[b]), estimates[b])


def draw(logits: torch.Tensor, members: Sequence[Member], chains: Sequence[list[int]],
         qs: Sequence[list[torch.Tensor]]) -> list[tuple[int, float]]:
    """logits [n, V] -> per member a token and the draft's probability of it: the argmax for
    greedy members, else a draw from q = probabilities(logits) (the target's processing), appended
    to its qs; a member's penalties count its generated tokens and its chain drafted so far
    (`chains`), as the verifier's count them at that position."""
    confidence, best = torch.softmax(logits.float(), -1).max(-1)
    best, confidence = best.tolist(), confidence.tolist()  # one host sync for the greedy rows
    out = []
    for j, (m, chain, q_list) in enumerate(zip(members, chains, qs)):
        row = penalized(logits[j:j + 1], m, [chain])  # [1, V]
        if m.params.greedy:
            top, x = torch.softmax(row.float(), -1).max(-1) if m.params.penalized else (confidence[j], best[j])
            out.append((int(x), float(top)))
            continue
        q = probabilities(row, m.params)  # [1, V]
        q_list.append(q)
        x = int(sample(q, m.generator))
        out.append((x, float(q[0, x])))
    return out


def penalized(logits: torch.Tensor, m: Member, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [E, V] after each of `paths` (the draft's tokens from the root) less m's presence and
    frequency penalties, counted as the verifier counts them there: the generated tokens and the
    path (verify.py); as they are where m has none."""
    return penalize(logits, m.params, m.tokens[m.prompt_len:], paths) if m.params.penalized else logits
