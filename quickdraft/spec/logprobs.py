"""Log-probabilities of committed tokens (OpenAI's logprobs / top_logprobs).

They are the target's raw distribution at the token's position: log_softmax of the model's logits,
before the request's temperature, penalties, logit bias, truncation (top-k, top-p, min-p) or
grammar mask, as vLLM reports by default (logprobs_mode "raw_logprobs") and as OpenAI's do not
move with temperature; a greedy request's would otherwise all be 0. A drafted token the target
accepted gets the logits of its position in the verify pass: the same bits plain decoding gives
there where the kernels are batch invariant. Knows nothing of the engine or of HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float                      # the committed token's
    top: tuple[tuple[int, float], ...]  # the likeliest tokens (id, logprob), likeliest first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [m, V] at the positions that scored `tokens` [m] -> each one's log-probability and
    the `top` likeliest alternatives there (the whole vocabulary where it is smaller)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = logp[torch.arange(len(tokens), device=logp.device), torch.tensor(tokens, device=logp.device)]
    top = min(top, logp.shape[-1])
    values, ids = logp.topk(top, dim=-1)  # [m, top]
    # one host sync (rows that ask only): float64 holds every token id and float32 logprob exactly
    rows = torch.cat([chosen[:, None].double(), values.double(), ids.double()], dim=-1).tolist()  # [m, 1+2*top]
    return [TokenLogprob(r[0], tuple(zip(map(int, r[1 + top:]), r[1:1 + top]))) for r in rows]
