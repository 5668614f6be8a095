"""The verifier: one pure function for greedy and sampled decoding, batch 1 and batch N.

p is the target's distribution, q the proposer's. Draft token x at position i is accepted if
u < p_i(x) / q_i(x) (u uniform in [0, 1)); at the first rejection a *recovered* token is drawn
from normalize(max(0, p_i - q_i)); if every draft token is accepted a *bonus* token is drawn
from p_k. Greedy is p = one-hot(argmax), deterministic proposers have q = one-hot(x): the same
arithmetic then accepts exactly the drafts that equal the target's argmax. For greedy rows that
arithmetic is evaluated in closed form (p(x) = [x == argmax]; the residual and the bonus are both
one-hot at the argmax) instead of on [k+1, V] one-hot tensors. Knows nothing of models or caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from quickdraft.sampling import SamplingParams, probabilities


@dataclass
class Verdict:
    accepted: list[int]      # per row: how many draft tokens were accepted (0..draft length)
    tokens: list[list[int]]  # per row: the accepted drafts, then one recovered or bonus token


def verify(draft: torch.Tensor, draft_lens: Sequence[int],
           q: torch.Tensor | Sequence[torch.Tensor | None] | None,
           target_logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]) -> Verdict:
    """draft: [B, k] token ids (row b uses its first draft_lens[b]; the rest is padding);
    q: [B, k, V] proposer probabilities, or per row [>= draft_lens[b], V] or None, or None for
    all rows; None means a deterministic proposer (q = one-hot(draft));
    target_logits: [B, k+1, V], position i scoring the token after draft[:, :i].
    params / generators: per row (each request has its own settings and RNG)."""
    B = draft.shape[0]
    rows = []  # per row: (p [n+1, V] or argmax [n+1] for greedy rows, q [n, V] or None, accept flags [n])
    for b in range(B):
        n = draft_lens[b]
        x = draft[b, :n]
        if params[b].greedy:
            best = target_logits[b, :n + 1].argmax(-1)  # [n+1]
            rows.append((best, None, best[:n] == x))
            continue
        p = probabilities(target_logits[b, :n + 1], params[b])
        steps = torch.arange(n, device=x.device)
        q_b = None if q is None else q[b]
        q_row = None if q_b is None else q_b[:n].float()
        q_x = torch.ones(n, device=x.device) if q_row is None else q_row[steps, x]
        u = torch.rand(n, generator=generators[b], device=x.device)
        rows.append((p, q_row, u * q_x < p[steps, x]))  # u < p/q without dividing by q = 0
    flags = torch.cat([ok for _, _, ok in rows]).tolist() if B else []  # first host sync
    accepted, offset = [], 0
    for b in range(B):
        ok = flags[offset:offset + draft_lens[b]]
        offset += draft_lens[b]
        accepted.append(ok.index(False) if False in ok else draft_lens[b])
    picks = []
    for b, (p, q_row, _) in enumerate(rows):
        n_acc, n = accepted[b], draft_lens[b]
        if params[b].greedy:
            picks.append(p[n_acc:n_acc + 1])  # recovered or bonus: the argmax either way
            continue
        dist = p[n_acc]  # bonus: every draft accepted
        if n_acc < n:
            q_at = (torch.zeros_like(dist).scatter_(0, draft[b, n_acc:n_acc + 1], 1.0)
                    if q_row is None else q_row[n_acc])
            residual = (dist - q_at).clamp_(min=0)
            # An all-zero residual means p == q up to rounding, where rejection cannot happen in
            # exact arithmetic; p is then the right distribution to draw from.
            dist = torch.where(residual.sum() > 0, residual, dist)
        picks.append(torch.multinomial(dist, 1, generator=generators[b]))
    if not B:
        return Verdict([], [])
    host = torch.cat([torch.cat(picks), draft.flatten()]).tolist()  # second host sync
    nxt, drafted = host[:B], host[B:]
    k = draft.shape[1]
    tokens = [drafted[b * k:b * k + accepted[b]] + [nxt[b]] for b in range(B)]
    return Verdict(accepted, tokens)
