"""The verifier: one pure function for greedy and sampled decoding, chains and trees, batch 1 and N.

p is the target's distribution, q the proposer's. The walk starts at the root (the newest
committed token) and tries its children in node order: child x is accepted if u < p(x) / q(x)
(u uniform in [0, 1)); after a rejected child the next sibling is tried against
p <- normalize(max(0, p - q)) (recursive rejection sampling, SpecInfer / SpecTr: exact for the
target's distribution whatever each sibling's q); an accepted child becomes the node whose
children are tried, against p at its own position. Where no child is accepted one token is drawn
from what is left of p: a *recovered* token after a rejection, a *bonus* token at a leaf. A chain
is the tree in which every node has one child.

Greedy is p = one-hot(argmax), deterministic proposers have q = one-hot(x): the same arithmetic
then accepts the first child equal to the target's argmax and ends with that argmax; greedy rows
evaluate it in closed form. Each node's test, and each node's final draw, is computed before the
walk: a sibling's residual depends only on the siblings before it (it is tried only if they were
all rejected), so one host sync serves the step.

A grammar's masks (grammar.py) restrict p at every position to the tokens allowed there (the
logits of the others become -inf before temperature, top-k and top-p), and q at each node to those
allowed after its parent, renormalized: the engine cuts a draft at its forbidden tokens, so a kept
node's token is distributed as q masked that way, and the walk stays exact for the masked p.
OpenAI's presence and frequency penalties count the tokens generated before each position: at
node i those committed so far and the tokens on the path from the root to node i (each node of a
tree counts its own path: node_paths), so every position is scored as plain decoding would score
it after that path. Knows nothing of models or caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from quickdraft.kernels import argmax
from quickdraft.spec.draft_contract import Draft
from quickdraft.spec.sampling import SamplingParams, biased, penalize, probabilities, sample


@dataclass(frozen=True)
class Verdict:
    kept: list[list[int]]    # per row: the accepted nodes, root to leaf (node indices, ascending)
    tokens: list[list[int]]  # per row: the accepted nodes' tokens, then one recovered or bonus token


def sibling_ranks(parents: Sequence[int]) -> list[list[int]]:
    """Nodes grouped by how many siblings precede them: within a group no two share a parent."""
    seen: dict[int, int] = {}
    ranks: list[list[int]] = []
    for i, p in enumerate(parents):
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        if rank == len(ranks):
            ranks.append([])
        ranks[rank].append(i)
    return ranks


def _masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits [n+1, V] with the tokens mask [n+1, V] forbids at -inf (None: as they are)."""
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))


def node_paths(draft: Draft) -> list[list[int]]:
    """[n+1] per position the target scores (the root, then each node), the draft's tokens before
    the token scored there: none at the root, node i's path (root to node, itself included) after it."""
    paths: list[list[int]] = [[]]
    for i, p in enumerate(draft.tree):
        paths.append(paths[p + 1] + [draft.tokens[i]])
    return paths


def _greedy_tests(draft: Draft, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n+1, V] -> (accepted if reached [n], final token at each of root and nodes [n+1])."""
    best = argmax(logits)  # [n+1]: the target's token after the root and after each node
    if not draft.tokens:
        return best[:0], best
    parents = torch.tensor(draft.tree, device=logits.device) + 1
    return best[parents] == torch.tensor(draft.tokens, device=logits.device), best


def _sampled_tests(draft: Draft, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n+1, V] -> (accepted if reached [n], final draw at each of root and nodes [n+1]);
    mask [n+1, V]: the tokens a grammar allows at each position (None: all)."""
    device, n = logits.device, len(draft.tokens)
    residual = probabilities(_masked(logits, mask), params)  # [n+1, V]: row 1+i (0 = the root) becomes what is left
                                              # of p at node i once its children have been tried
    x = torch.tensor(draft.tokens, device=device, dtype=torch.long)
    u = torch.rand(n, generator=generator, device=device)
    ok = torch.zeros(n, dtype=torch.bool, device=device)
    parents = draft.tree
    for group in sibling_ranks(parents):
        nodes = torch.tensor(group, device=device)
        at = torch.tensor([parents[i] + 1 for i in group], device=device)
        xs = x[nodes]
        mass = residual.sum(-1)[at]  # [m] p = residual / mass at each parent: compare and subtract at
        r_x = residual[at, xs]       # [m] the residual's own scale
        # An all-zero residual means p == q up to rounding, where rejection cannot happen in exact
        # arithmetic; p is then the right distribution to draw from.
        if draft.q is None:  # q = one-hot(x): max(0, p - q) is p without x
            ok[nodes] = u[nodes] * mass < r_x
            residual[at, xs] = torch.where(mass > r_x, 0.0, r_x)
        else:
            q = draft.q[nodes].float()  # [m, V]
            if mask is not None:  # as the cut at forbidden tokens conditions it: masked, renormalized
                q = q * mask[at]
                q = q / q.sum(-1, keepdim=True).clamp_(min=torch.finfo(q.dtype).tiny)
            ok[nodes] = u[nodes] * q[torch.arange(len(group), device=device), xs] * mass < r_x  # u < p/q without
            r = residual[at]                                                                    # dividing by q = 0
            left = (r - q * mass[:, None]).clamp_(min=0)
            residual[at] = torch.where(left.sum(-1, keepdim=True) > 0, left, r)
    return ok, sample(residual, generator)


def _scored(draft: Draft, logits: torch.Tensor, params: SamplingParams, generated: Sequence[int] | None
            ) -> torch.Tensor:
    """A row's logits [1+W, V] -> [n+1, V] at its root and nodes, less its penalties where it has any."""
    logits = logits[:len(draft.tokens) + 1]
    if generated is None or not params.penalized:
        return logits
    return penalize(logits, params, generated, node_paths(draft))


def verify(drafts: Sequence[Draft], target_logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator], masks: Sequence[torch.Tensor | None] | None = None,
           generated: Sequence[Sequence[int] | None] | None = None) -> Verdict:
    """drafts: per row, the tree to verify (n_b nodes; q per node, or None for deterministic);
    target_logits: [B, 1+W, V] with W >= every n_b: position 0 scores the token after the row's
    root, position 1+i the token after node i (padding past 1+n_b is ignored);
    params / generators: per row (each request has its own settings and RNG; a logit bias is added
    to p's logits, greedy rows' too);
    masks: per row, a grammar's allowed tokens [1+n_b, V] bool at the root and after each node,
    or None (unconstrained);
    generated: per row, the tokens it generated so far, which its presence and frequency penalties
    count (None, or a row whose params have none: no penalties)."""
    masks = masks or [None] * len(drafts)
    generated = generated or [None] * len(drafts)
    tests = [_greedy_tests(d, _masked(biased(_scored(d, target_logits[b], params[b], generated[b]), params[b]),
                                      masks[b]))
             if params[b].greedy else
             _sampled_tests(d, _scored(d, target_logits[b], params[b], generated[b]), params[b], generators[b],
                            masks[b])
             for b, d in enumerate(drafts)]
    if not tests:
        return Verdict([], [])
    host = torch.cat([t.long() for pair in tests for t in pair]).tolist()  # the one host sync
    kept_rows, token_rows, offset = [], [], 0
    for draft in drafts:
        n = len(draft.tokens)
        ok, final = host[offset:offset + n], host[offset + n:offset + 2 * n + 1]
        offset += 2 * n + 1
        children: dict[int, list[int]] = {}
        for i, p in enumerate(draft.tree):
            children.setdefault(p, []).append(i)
        kept, node = [], -1
        while (nxt := next((c for c in children.get(node, ()) if ok[c]), None)) is not None:
            kept.append(nxt)
            node = nxt
        if final[node + 1] < 0:
            raise ValueError(f"the target's distribution for row {len(kept_rows)} is not one (NaN or all "
                             f"zero): expected finite probabilities summing to 1")
        kept_rows.append(kept)
        token_rows.append([draft.tokens[i] for i in kept] + [final[node + 1]])
    return Verdict(kept_rows, token_rows)
