"""verify(): the accept / recover / bonus rule, greedy and sampled, chains and trees, batch 1 and N.

Oracles: hand-made logits whose argmax is clear (greedy cases, table-driven), and for sampling the
distribution the speculative-sampling theorem promises: the emitted tokens follow p exactly,
whatever q is. Those are chi-square goodness-of-fit tests with a stated false-failure probability,
each paired with a deliberately biased verifier (written here) that the same test must reject.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import pytest
import torch

from quickdraft.proposers.base import Draft
from quickdraft.spec.sampling import SamplingParams
from quickdraft.spec.verify import verify
from support.laws import ALPHA, C0, JOINT, N_K1, PM, QM, T1, P, Q, V, chi_square_p_value, clear_logits, counts_of, log

GREEDY = SamplingParams()
Z_ALPHA = 4.892  # two-sided normal quantile for ALPHA: P(|Z| > 4.892) = 1e-6


def test_chi_square_helper_matches_textbook_values() -> None:
    # chi-square(4) upper 1% point is 13.277: counts built so the statistic is exactly that.
    probs = torch.full((5,), 0.2)
    d = math.sqrt(13.277 * 200 / 2)  # two cells off by d, each expecting 200: 2 d^2 / 200 = 13.277
    counts = torch.tensor([200 + d, 200 - d, 200, 200, 200])
    assert chi_square_p_value(counts, probs) == pytest.approx(0.01, rel=1e-3)
    # Pooling: two cells expecting 5 each become one cell expecting 10 (4 cells, df 3).
    probs = torch.tensor([0.49, 0.49, 0.01, 0.01])
    assert chi_square_p_value(torch.tensor([490, 490, 10, 10]), probs) == pytest.approx(1.0)
    assert chi_square_p_value(torch.tensor([490, 490, 20, 0]), probs) == pytest.approx(1.0)


@dataclass
class Chains:
    accepted: list[int]      # per row: accepted drafts
    tokens: list[list[int]]  # per row: accepted drafts, then the recovered or bonus token


def verify_chains(draft: torch.Tensor, draft_lens: Sequence[int], q: torch.Tensor | None,
                  target_logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator]) -> Chains:
    """verify() on chains given as padded tensors: draft [B, k], q [B, k, V] or None, logits [B, k+1, V]
    (the form the biased verifiers below are written in)."""
    drafts = [Draft(draft[b, :n].tolist(), None if q is None else q[b, :n]) for b, n in enumerate(draft_lens)]
    verdict = verify(drafts, target_logits, params, generators)
    return Chains([len(kept) for kept in verdict.kept], verdict.tokens)


# -- greedy, table-driven --------------------------------------------------------------------------------

def run_greedy(rows: list[tuple[list[int], list[int]]], k: int) -> Chains:
    """rows: (draft, target argmax per position 0..len(draft)); padded to k with values that would
    be accepted if the verifier read past a row's length (padding repeats the argmaxes)."""
    B = len(rows)
    draft = torch.zeros(B, k, dtype=torch.long)
    logits = torch.zeros(B, k + 1, V)
    for b, (d, argmaxes) in enumerate(rows):
        assert len(argmaxes) == len(d) + 1
        pad_argmax = list(argmaxes) + [(argmaxes[-1] + 1 + i) % V for i in range(k - len(d))]
        draft[b] = torch.tensor(list(d) + pad_argmax[len(d):k], dtype=torch.long)
        logits[b] = clear_logits(pad_argmax, seed=b)
        # Past the row's bonus position the "argmax" rows agree with the padding drafts, so reading
        # them would accept more tokens than the row has.
    gens = [torch.Generator().manual_seed(b) for b in range(B)]
    return verify_chains(draft, [len(d) for d, _ in rows], None, logits, [GREEDY] * B, gens)


GREEDY_CASES = {
    # name: (draft, target argmax at positions 0..len(draft), expected accepted, expected tokens)
    "empty draft": ([], [3], 0, [3]),
    "all accepted, bonus": ([2, 5, 1], [2, 5, 1, 7], 3, [2, 5, 1, 7]),
    "mismatch at 0": ([2, 5, 1], [4, 5, 1, 7], 0, [4]),
    "mismatch in the middle": ([2, 5, 1], [2, 6, 1, 7], 1, [2, 6]),
    "mismatch at the last": ([2, 5, 1], [2, 5, 0, 7], 2, [2, 5, 0]),
    "single accepted": ([8], [8, 8], 1, [8, 8]),
    "single rejected": ([8], [9, 8], 0, [9]),
}


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_greedy_table(name: str) -> None:
    d, argmaxes, accepted, tokens = GREEDY_CASES[name]
    verdict = run_greedy([(d, argmaxes)], k=len(d))
    assert (verdict.accepted, verdict.tokens) == ([accepted], [tokens])


@pytest.mark.parametrize("k", [0, 3])
def test_empty_draft_returns_exactly_the_argmax(k: int) -> None:
    # k = 0 (plain decoding), and a row whose draft_len is 0 inside a k = 3 batch.
    verdict = run_greedy([([], [6])], k=k)
    assert (verdict.accepted, verdict.tokens) == ([0], [[6]])


def test_mixed_rows_in_one_batch_ignore_padding() -> None:
    names = list(GREEDY_CASES)
    rows = [GREEDY_CASES[n][:2] for n in names]
    k = max(len(d) for d, _ in rows) + 2  # every row is padded, some by 3+ positions
    verdict = run_greedy(rows, k=k)
    assert verdict.accepted == [GREEDY_CASES[n][2] for n in names]
    assert verdict.tokens == [GREEDY_CASES[n][3] for n in names]
    # Row by row alone gives the same: a row's verdict does not depend on its neighbours.
    for n in names:
        alone = run_greedy([GREEDY_CASES[n][:2]], k=k)
        assert (alone.accepted, alone.tokens) == ([GREEDY_CASES[n][2]], [GREEDY_CASES[n][3]])


def one_hot_q(draft: torch.Tensor, V_: int) -> torch.Tensor:
    return torch.zeros(*draft.shape, V_).scatter_(-1, draft[..., None], 1.0)  # [B, k, V]


@pytest.mark.parametrize("params", [GREEDY, T1, SamplingParams(temperature=0.7, top_k=4)],
                         ids=["greedy", "t1", "t0.7-topk4"])
def test_deterministic_q_none_equals_explicit_one_hot(params: SamplingParams) -> None:
    B, k = 64, 3
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    # Drafts: half the positions copy the target's argmax, half are random, so both paths run.
    draft = torch.where(torch.rand(B, k, generator=g) < 0.5, logits[:, :k].argmax(-1),
                        torch.randint(0, V, (B, k), generator=g))
    lens = torch.randint(0, k + 1, (B,), generator=g).tolist()
    run = lambda q: verify_chains(draft, lens, q, logits, [params] * B,
                           [torch.Generator().manual_seed(100 + b) for b in range(B)])
    none, explicit = run(None), run(one_hot_q(draft, V))
    assert (none.accepted, none.tokens) == (explicit.accepted, explicit.tokens)
    assert 0 < sum(none.accepted) < sum(lens)  # both accepting and rejecting happened
    if params.greedy:  # and greedy agrees with the argmax rule directly
        for b in range(B):
            n = none.accepted[b]
            assert draft[b, :n].tolist() == logits[b, :n].argmax(-1).tolist()
            assert none.tokens[b][-1] == int(logits[b, n].argmax())


# -- sampling: the emitted tokens follow p ---------------------------------------------------------------

Verifier = Callable[..., Chains]

P_BONUS = torch.tensor([0.10, 0.10, 0.40, 0.10, 0.10, 0.20])


def always_accept(draft, draft_lens, q, target_logits, params, generators) -> Chains:
    """Biased: emits the drafts (so x ~ q), then a bonus from p."""
    g = generators[0]
    bonus = torch.multinomial(torch.softmax(target_logits[:, -1].float(), -1), 1, generator=g)[:, 0]
    rows = draft.tolist()
    return Chains([len(r) for r in rows], [r + [int(t)] for r, t in zip(rows, bonus)])


def recover_from_p(draft, draft_lens, q, target_logits, params, generators) -> Chains:
    """Biased (a classic bug): the right accept test, but a rejected position redraws from p
    instead of normalize(max(0, p - q)). Vectorised; temperature-1 params, full-length rows."""
    g = generators[0]
    B, k = draft.shape
    p = torch.softmax(target_logits.float(), -1)                       # [B, k+1, V]
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]                # [B, k]
    q_x = q.float().gather(-1, draft[..., None])[..., 0]               # [B, k]
    ok = torch.rand(B, k, generator=g) * q_x < p_x
    n = torch.where(ok.all(1), k, (~ok).int().argmax(1))               # first rejection, or k
    nxt = torch.multinomial(p[torch.arange(B), n], 1, generator=g)[:, 0]
    rows, n, nxt = draft.tolist(), n.tolist(), nxt.tolist()
    return Chains(n, [rows[b][:n[b]] + [nxt[b]] for b in range(B)])


def k1_draws(verifier: Verifier, n: int, p: torch.Tensor, q: torch.Tensor, params: SamplingParams,
             seed: int, p_logits: torch.Tensor | None = None) -> Chains:
    """n independent k = 1 steps: x ~ q, target logits log p (or p_logits) then log P_BONUS."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=g)   # [n, 1]
    first = log(p) if p_logits is None else p_logits
    logits = torch.stack([first, log(P_BONUS)])[None].expand(n, -1, -1)          # [n, 2, V]
    q_full = q[None, None].expand(n, 1, -1)                                      # [n, 1, V]
    return verifier(x, [1] * n, q_full, logits, [params] * n, [g] * n)


def test_k1_first_token_follows_p() -> None:
    verdict = k1_draws(verify_chains, N_K1, P, Q, T1, seed=0)
    first = counts_of([t[0] for t in verdict.tokens], 6)
    assert first[5] == 0, "a token with p = 0 was emitted"
    assert first[4] > 0  # p > 0 = q: reachable only through the recovered distribution
    assert chi_square_p_value(first, P) > ALPHA
    # Acceptance probability is sum_x min(p, q) = 0.05 + 0.10 + 0.20 + 0.15 = 0.5 exactly.
    acc = sum(verdict.accepted)
    assert abs(acc - 0.5 * N_K1) < Z_ALPHA * math.sqrt(N_K1 * 0.25)
    # Rows that accepted emit [x, bonus]; the bonus follows p at position 1; others emit one token.
    assert all(len(t) == a + 1 for t, a in zip(verdict.tokens, verdict.accepted))
    bonus = counts_of([t[1] for t in verdict.tokens if len(t) == 2], 6)
    assert chi_square_p_value(bonus, P_BONUS) > ALPHA


@pytest.mark.parametrize("biased", [always_accept, recover_from_p])
def test_k1_negative_controls_are_rejected(biased: Verifier) -> None:
    # Output laws: always_accept gives q; recover_from_p gives min(p,q) + 0.5 p =
    # [.20, .225, .30, .225, .05, 0]. Against p the expected statistic is N * sum((r-p)^2/p) ~ 0.15 N
    # (r = recover_from_p) = 6000 at N = 40000, far past the ALPHA critical value (33.4 for df 4).
    verdict = k1_draws(biased, N_K1, P, Q, T1, seed=0)
    first = counts_of([t[0] for t in verdict.tokens], 6)
    assert chi_square_p_value(first, P) < ALPHA
    # A test so powerful could also reject everything: the fitting law passes on the same draws.
    law = Q if biased is always_accept else torch.minimum(P, Q) + 0.5 * P
    assert chi_square_p_value(first, law) > ALPHA


# Logit processing is applied to p: (params, logits, the processed p written out by hand).
LOGITS = torch.tensor([2.0, 1.2, 0.8, 0.3, -0.5, 0.1])
_e = lambda xs, t: [math.exp(x / t) for x in xs]
TOPK2 = torch.tensor(_e([2.0, 1.2], 0.7) + [0.0] * 4)
# T = 1.3: softmax = [.387, .209, .154, .105, .057, .090] (sorted: 0,1,2,3,5,4); the mass before
# tokens 0, 1, 2 is 0, .387, .596 < 0.7 and before token 3 it is .749 >= 0.7: top_p 0.7 keeps {0,1,2}.
TOPP = torch.tensor(_e([2.0, 1.2, 0.8], 1.3) + [0.0] * 3)
PROCESSED = {
    "t0.7-topk2": (SamplingParams(temperature=0.7, top_k=2), TOPK2 / TOPK2.sum()),
    "t1.3-topp0.7": (SamplingParams(temperature=1.3, top_p=0.7), TOPP / TOPP.sum()),
}
N_PROCESSED = 10_000


@pytest.mark.parametrize("case", PROCESSED)
def test_temperature_top_k_top_p_are_applied_to_p(case: str) -> None:
    params, p_hand = PROCESSED[case]
    q = torch.full((6,), 1 / 6)  # drafts land outside the kept set often
    verdict = k1_draws(verify_chains, N_PROCESSED, p_hand, q, params, seed=1, p_logits=LOGITS)
    kept = set((p_hand > 0).nonzero().flatten().tolist())
    assert {t[0] for t in verdict.tokens} <= kept  # whether accepted or recovered
    first = counts_of([t[0] for t in verdict.tokens], 6)
    assert chi_square_p_value(first, p_hand) > ALPHA
    # The unprocessed softmax of the same logits must fail (the test can see the processing).
    assert chi_square_p_value(first, torch.softmax(LOGITS, -1)) < ALPHA


def test_bonus_position_is_processed_too() -> None:
    # top_k = 2 at the bonus position keeps P_BONUS's two largest: tokens 2 (0.4) and 5 (0.2).
    params = SamplingParams(temperature=1.0, top_k=2)
    verdict = k1_draws(verify_chains, 4_000, P, P, params, seed=2, p_logits=log(P))
    bonus = [t[1] for t in verdict.tokens if len(t) == 2]
    assert len(bonus) > 1000 and set(bonus) <= {2, 5}
    assert chi_square_p_value(counts_of(bonus, 6), torch.tensor([0, 0, 2 / 3, 0, 0, 1 / 3])) > ALPHA


# -- k = 2: the joint law of the first two emitted tokens ---------------------------------------------------

N_K2 = 20_000


def markov_step(verifier: Verifier, last: torch.Tensor, g: torch.Generator, k: int = 2) -> Chains:
    """One speculative step per row from context token last [B]: drafts x_i ~ QM[x_{i-1}],
    target logits log PM[x_{i-1}] at each of the k+1 positions (the target conditions on the drafts)."""
    B = last.shape[0]
    prev, drafts, qs, ps = last, [], [], [PM[last]]
    for _ in range(k):
        q = QM[prev]                                                     # [B, V]
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        drafts.append(x)
        qs.append(q)
        ps.append(PM[x])
        prev = x
    draft, q, p = torch.stack(drafts, 1), torch.stack(qs, 1), torch.stack(ps, 1)
    return verifier(draft, [k] * B, q, log(p), [T1] * B, [g] * B)


def first_two_tokens(verifier: Verifier, n: int, seed: int) -> torch.Tensor:
    """Counts [V, V] of the first two emitted tokens; a second step runs where the first emitted one."""
    g = torch.Generator().manual_seed(seed)
    first = markov_step(verifier, torch.full((n,), C0), g)
    pairs = [t[:2] for t in first.tokens if len(t) >= 2]
    short = [t[0] for t in first.tokens if len(t) == 1]
    if short:
        second = markov_step(verifier, torch.tensor(short), g)
        pairs += [[a, t[0]] for a, t in zip(short, second.tokens)]
    assert len(pairs) == n
    pairs_t = torch.tensor(pairs)
    return torch.bincount(pairs_t[:, 0] * 5 + pairs_t[:, 1], minlength=25).view(5, 5)


def test_k2_joint_of_first_two_tokens_follows_p() -> None:
    counts = first_two_tokens(verify_chains, N_K2, seed=4)
    assert (counts[JOINT == 0] == 0).all(), "a pair with probability 0 was emitted"
    assert chi_square_p_value(counts, JOINT) > ALPHA
    # The second token conditioned on the first: each row of counts follows PM[t1].
    for t1 in range(5):
        if JOINT[t1].sum() > 0:
            assert chi_square_p_value(counts[t1], PM[t1]) > ALPHA


def test_k2_negative_control_is_rejected() -> None:
    counts = first_two_tokens(recover_from_p, N_K2, seed=4)
    assert chi_square_p_value(counts, JOINT) < ALPHA
