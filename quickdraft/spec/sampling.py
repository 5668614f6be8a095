"""SamplingParams and the logits -> probabilities transform shared by target (p) and proposer (q).

Temperature 0 means greedy: the distribution is one-hot at the argmax, so the verifier needs no
second code path. Knows nothing of models or proposers.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from quickdraft.errors import InvalidSamplingParams
from quickdraft.kernels import argmax

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string; matching is incremental (tokenizer.StopStringFilter), this bounds memory
TOP_P_CANDIDATES = 256  # top-p looks here first: enough mass for almost every real distribution
F32_TINIEST = 2.0 ** -149  # the smallest positive float32: temperatures below it are 0 there
MAX_LOGIT_BIAS = 1024  # biased tokens per request
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: each bias in [-100, 100]
PENALTY_RANGE = 2.0  # OpenAI's: presence_penalty and frequency_penalty in [-2, 2]
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0          # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128  # 0: none, the prompt only prefilled (and scored where its request asks)
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0      # tokens under min_p times the likeliest one's probability are cut (0 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit) pairs, ids
                                                    # ascending; a {id: bias} mapping is taken too
    presence_penalty: float = 0.0   # OpenAI's: subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated so far
    logprobs: int | None = None     # report each new token's log-probability and this many likeliest
                                    # alternatives' (0..MAX_TOP_LOGPROBS); None: no log-probabilities

    def __post_init__(self) -> None:
        def fail(name: str, expected: str, found: object) -> None:
            raise InvalidSamplingParams(f"{name} must be {expected}, found {found!r}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            fail("temperature", "a number in [0, 100] (0 = greedy)", self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 = disabled)", self.top_k)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "a number in (0, 1]", self.top_p)
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "a number in [0, 1] (0 = disabled)", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= PENALTY_RANGE:
                fail(name, f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off)", value)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            fail("logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives reported)",
                 self.logprobs)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            fail("seed", "None or an integer in [0, 2**63)", self.seed)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 0:
            fail("max_new_tokens", "an integer >= 0 (0: the prompt is only scored)", self.max_new_tokens)
        if not isinstance(self.stop, (str, list, tuple)):
            fail("stop", "a string or a list of strings", self.stop)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            shown = repr(stop)  # cut: the request may carry megabytes of stop strings
            raise InvalidSamplingParams(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                        f"{MAX_STOP_CHARS} characters, found {shown[:200]}"
                                        f"{f'... ({len(shown)} characters)' if len(shown) > 200 else ''}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            fail("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            fail("stop_token_ids", "non-negative integers", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "true or false", self.ignore_eos)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's own RNG: seeded requests reproduce whatever shares their batch."""
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> pairs by ascending id, or InvalidSamplingParams."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias) if isinstance(bias, (list, tuple)) else None
    ok = pairs is not None and len(pairs) <= MAX_LOGIT_BIAS and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
        and type(pair[1]) in (int, float) and abs(pair[1]) <= LOGIT_BIAS_RANGE for pair in pairs)
    if not ok or len({t for t, _ in pairs}) != len(pairs):
        shown = repr(bias)
        raise InvalidSamplingParams(f"logit_bias must map at most {MAX_LOGIT_BIAS} distinct token ids >= 0 to biases "
                                    f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], found {shown[:200]}")
    return tuple(sorted((t, float(b)) for t, b in pairs))


def biased(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] plus the request's logit_bias (the same tensor when it has none)."""
    if not params.logit_bias:
        return logits
    ids = [t for t, _ in params.logit_bias]
    if ids[-1] >= logits.shape[-1]:
        raise InvalidSamplingParams(f"logit_bias names token {ids[-1]}, but the vocabulary has {logits.shape[-1]} "
                                    f"(ids 0..{logits.shape[-1] - 1})")
    out = logits.clone()
    out[..., ids] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
    return out


def penalize(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
             paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [P, V] at P positions -> float32 less OpenAI's penalties, frequency_penalty * c[t] +
    presence_penalty * (c[t] > 0), c[t] counting token t in `generated` (the committed new tokens)
    and in paths[i] (the tokens drafted before position i). Only the tokens counted are touched."""
    base = Counter(generated)
    ids = sorted(base.keys() | {t for path in paths for t in path})
    out = logits.float().clone()
    if not ids:
        return out
    device = logits.device
    at = {t: j for j, t in enumerate(ids)}
    counts = torch.tensor([float(base[t]) for t in ids], device=device).repeat(len(paths), 1)  # [P, U]
    rows = [i for i, path in enumerate(paths) for _ in path]
    if rows:
        cols = [at[t] for path in paths for t in path]
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                          torch.ones(len(rows), device=device), accumulate=True)
    out[:, torch.tensor(ids, device=device)] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32 after the logit bias, temperature, min-p,
    top-k and top-p.

    Greedy gives one-hot(argmax). Apply the same call to target and proposer logits.
    """
    logits = biased(logits, params).float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
    # Dividing the gaps to the largest logit, not the logits, is the same softmax, but nothing can
    # overflow: (l - max) / T <= 0 for any T (a tiny T sends every other token to -inf, weight 0),
    # where l / T could give +inf and softmax inf - inf = NaN.
    shifted = logits - logits.amax(-1, keepdim=True)  # [..., V], 0 at the max
    logits = shifted / params.temperature
    if params.temperature < F32_TINIEST:  # T is 0 in float32: the max's 0 / 0 is NaN, its limit 0
        logits = logits.masked_fill(shifted == 0, 0.0)
    if params.min_p > 0.0:  # p / p_max = exp(logit - 0) >= min_p: the likeliest token always stays
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return _top_p(probs, params.top_p) if params.top_p < 1.0 else probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-probable prefix whose mass reaches top_p (the first token always
    stays), renormalized. The prefix is looked for among the TOP_P_CANDIDATES most probable tokens,
    and among all of them only in the rows whose candidates hold less than top_p: the same result
    as a full sort up to the order of equal probabilities, without sorting the whole vocabulary on
    every step. Each row's result is its own (never decided by another row's mass): verification
    scores positions only as far as its walk reaches (engine/scores.py)."""
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    n = min(flat.shape[-1], TOP_P_CANDIDATES)
    cand_p, cand_i = flat.topk(n, dim=-1)  # sorted, descending
    kept = _prefix(flat, cand_p, cand_i, top_p)
    if n < flat.shape[-1]:
        short = (cand_p.sum(-1) < top_p).nonzero()[:, 0]  # the rows whose prefix may go past them
        if len(short):
            kept[short] = _prefix(flat[short], *flat[short].sort(dim=-1, descending=True), top_p)
    return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)


def _prefix(probs: torch.Tensor, cand_p: torch.Tensor, cand_i: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [R, V] with only the smallest prefix of each row's candidates (cand_p, cand_i: sorted
    descending) whose mass reaches top_p kept."""
    outside = (cand_p.cumsum(-1) - cand_p) >= top_p
    # A top_p that is 0 in float32 (under 1.4e-45) would cut even the first token: 0 >= 0.
    outside[..., 0] = False
    return torch.zeros_like(probs).scatter_(-1, cand_i, cand_p.masked_fill(outside, 0.0))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [..., V] (weights >= 0, any scale) -> [...], by inverse CDF: on a
    CPU a fifth of torch.multinomial's cost for a 49k vocabulary. A token of weight 0 is never
    drawn; a row that is not a distribution (NaN, all zero) gives -1."""
    cdf = probs.reshape(-1, probs.shape[-1]).cumsum(-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total after rounding too
    token = torch.searchsorted(cdf, u, right=True)[:, 0]  # the first token whose cdf passes u
    return torch.where((total[:, 0] > 0) & total[:, 0].isfinite(), token, -1).reshape(probs.shape[:-1])
