"""The engine's decisions, from numbers alone: which waiting request is admitted next, how many
prompt tokens a step may prefill (riding in the decode pass, or in passes of their own), how many
draft tokens each row verifies and whether the rows fit one batch-invariant pass, how many of each
row's positions the LM head scores before verifying, what verifying costs the proposers that pay
to draft; and the timing they are made from (t(N) of decode passes,
the last prefill pass). The engine (engine/batch.py) asks, then runs the passes and reports their
times back. No model, no tensors: tests/test_scheduler.py drives it with numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import TYPE_CHECKING, Callable, Sequence

from quickdraft.engine.policy import POLICIES, PolicyName, RowDraft, StepCost, choose_draft_lengths, first_scored
from quickdraft.engine.prefill import RETIME, next_admitted, step_allowance
from quickdraft.spec.draft_contract import MAX_K, PassCost

if TYPE_CHECKING:
    from quickdraft.engine.rows import Request


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 1              # rows decoded together
    max_seq_len: int | None = None  # prompt + new tokens per row; None = the model's context
    policy: PolicyName = "goodput"  # how draft lengths are chosen per step (engine/policy.py)
    max_step_tokens: int | None = 64  # goodput policy: tokens fed per step at most (the CPU
                                      # kernel's batch-invariant range, kernels.MAX_ROWS)
    prefill_chunk: int | None = None  # prompt tokens prefilled per step at most; None: as many as
                                      # stall running rows little (engine/prefill.py), whole
                                      # prompts while no row decodes

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, found {self.max_batch!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, found {self.max_seq_len!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, found {self.policy!r}")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool)
                                               or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1 or None, found {self.prefill_chunk!r}")


@dataclass(frozen=True)
class DecodePlan:
    """One decode pass over a set of rows: each row's draft tokens to verify, the positions of each
    the LM head scores before verifying (engine/scores.py: the rest as the walk reaches them), and
    the filling prompt's tokens that ride along (0: none). None from `plan_decode`: the rows do not
    fit one batch-invariant pass and go in halves, each planned anew."""
    lengths: tuple[int, ...]
    scored: tuple[int, ...]
    ride: int = 0


@dataclass(frozen=True)
class Pass:
    """Rows lo..hi-1 (of those a step plans) decoded together, as `plan` says."""
    lo: int
    hi: int
    plan: DecodePlan


class Scheduler:
    def __init__(self, config: EngineConfig, cost: StepCost, invariant_rows: int | None, ragged: bool) -> None:
        """invariant_rows: the tokens one pass may feed with each row's bits its own (None: any);
        ragged: passes feed each row's own tokens (else every row padded to the widest)."""
        self.config, self.cost = config, cost
        self.invariant_rows, self.ragged = invariant_rows, ragged
        self.waiting: list[Request] = []
        self.passed: dict[str, int] = {}  # request id -> admissions it waited through (prefill.next_admitted)
        self.steps = 0                    # steps begun
        self.timed: dict[int, int] = {}   # rows -> the last step they decoded in a pass of their own
        self.last_prefill: tuple[int, float] | None = None  # (tokens, seconds) of the last prefill pass
        self.room: int | None = 0     # prompt tokens this step may still prefill (None: no limit)
        self.room_set = False         # whether this step's allowance was asked for yet
        self.warm = False             # an engine's first decode pass is behind it

    # -- the queue ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request_id: str) -> Request | None:
        """Drop the waiting request with that id and return it; None if none waits."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                self.passed.pop(request_id, None)
                return request
        return None

    def admits(self, holding: int) -> bool:
        """Whether a waiting request may take a row now that `holding` rows are held."""
        return bool(self.waiting) and holding < self.config.max_batch

    def next_admitted(self, cached: Callable[[Request], int]) -> Request:
        """Take the waiting request to admit now: the fewest prompt tokens left to prefill once its
        cached prefix (`cached`: its tokens the prefix cache holds) is in, none passed over forever
        (engine/prefill.py)."""
        left = [len(r.prompt_ids) - cached(r) for r in self.waiting]
        i = next_admitted(left, [self.passed.get(r.id, 0) for r in self.waiting])
        for earlier in self.waiting[:i]:
            self.passed[earlier.id] = self.passed.get(earlier.id, 0) + 1
        request = self.waiting.pop(i)
        self.passed.pop(request.id, None)
        return request

    # -- a step ---------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.steps += 1
        self.room_set = False

    def prefill_room(self, decoding: int, riding: bool = False) -> int | None:
        """Prompt tokens this step may still prefill while `decoding` rows decode; None: no limit (no
        row decodes, and no chunk size is asked for). The step's allowance (engine/prefill.py) is set
        at its first ask (`riding`: for a chunk riding in the decode pass, so none in a step that
        times the rows alone, every RETIME steps) and every prefilled token spends it; one without
        limit is set anew once rows decode (a prompt that joined them: the next gets a chunk)."""
        if not self.room_set or (self.room is None and decoding > 0):
            self.room = step_allowance(decoding, self.cost, self.last_prefill, self.config.prefill_chunk,
                                       self.untimed(decoding) if riding else 0)
            self.room_set = True
        return self.room

    def spend(self, tokens: int) -> None:
        """`tokens` prompt tokens went to a prefill pass (or rode in the decode pass to a prompt's
        end) this step, the pass failing or not: the room left is less by them."""
        if self.room is not None:
            self.room = max(self.room - tokens, 0)

    def close(self) -> None:
        """No more prefill this step: a chunk rode and its prompt goes on at the next, or the
        prompt that rode failed."""
        self.room, self.room_set = 0, True

    def plan_decode(self, offered: Sequence[RowDraft], ride: tuple[int, int] | None = None) -> DecodePlan | None:
        """The pass of rows offering `offered` drafts: the lengths to verify (engine/policy.py) and,
        for ride = (the filling prompt's tokens left, at most this many now), the tokens that ride.
        None where the pass would feed more than the batch-invariant rows: halves go instead."""
        lengths = choose_draft_lengths(offered, self.cost, self.config.policy, self.config.max_step_tokens)
        sizes = [1 + n for n in lengths]
        fed = sum(sizes) if self.ragged else len(sizes) * max(sizes)
        room = self.invariant_rows if self.invariant_rows is not None else 1 << 62
        if len(sizes) > 1 and fed > room:
            return None
        riding = 0 if ride is None else max(min(ride[0], ride[1], room - fed), 0)
        return DecodePlan(tuple(lengths), tuple(self._scored(r, n) for r, n in zip(offered, lengths)), riding)

    def plan_step(self, offered: Sequence[RowDraft], ride: tuple[int, int] | None = None) -> tuple[Pass, ...]:
        """The decode passes of a step whose rows offer `offered` drafts, in order: one pass where
        they fit a batch-invariant one (the chunk riding as plan_decode says), else halves, each
        planned on its own (its draft lengths chosen for its own rows), down to single rows; a
        chunk rides only where every row fits one pass (split, the prompt waits for the passes of
        its own after them)."""
        def passes(lo: int, hi: int, ride: tuple[int, int] | None) -> list[Pass]:
            plan = self.plan_decode(offered[lo:hi], ride)
            if plan is not None:
                return [Pass(lo, hi, plan)]
            mid = (lo + hi) // 2
            return passes(lo, mid, None) + passes(mid, hi, None)
        return tuple(passes(0, len(offered), ride))

    def _scored(self, row: RowDraft, n: int) -> int:
        """Positions of a row verifying n draft tokens to score first: all where passes are not
        ragged (there the head runs on an accelerator, where a host sync costs more than the rows
        it saves, or in torch's GEMM, whose bits depend on the rows) and for a row scored whole (a
        tree, a proposer that reads every position's top tokens: RowDraft.as_walked), else the
        expected cheapest (policy.first_scored), every one where the proposer gives no estimates."""
        if not self.ragged or row.accept_probs is None or not row.as_walked:
            return 1 + n
        return first_scored(list(accumulate(row.accept_probs[:n], mul)), self.cost.head_cost)

    def pass_cost(self, ks: Sequence[int]) -> PassCost | None:
        """What verification will cost the next step of rows whose requests draft up to ks tokens,
        for proposers that pay to draft (None under the fixed policy: every draft is verified
        whole, so its length must not depend on timing). The marginal cost is t(N)'s slope up to
        the drafts the rows may offer."""
        if self.config.policy == "fixed":
            return None
        n = len(ks)
        extra = max(1, min(sum(ks), (self.config.max_step_tokens or MAX_K * n) - n))
        base = self.cost.estimate(n)
        return PassCost(base, max(self.cost.estimate(n + extra) - base, 0.0) / extra, n)

    # -- what passes took -----------------------------------------------------------------------------

    def decoded(self, rows: int, tokens: int, seconds: float, riding: bool = False) -> None:
        """A decode pass of `rows` rows feeding `tokens` tokens took `seconds`: t(tokens) learns it
        (replaced outright after long untimed: what it was is stale), unless a prompt's chunk rode
        in it (its tokens cost by their context too: prefill.py). Not the engine's first: it pays
        one-time costs (first calls down the verifier's and the kernels' decode paths), twice a
        usual step's time, and taken as t(2) it had the policy decline drafts (policy.py, STALE)."""
        if not self.warm or riding:
            self.warm = True
            return
        if self.untimed(rows) >= RETIME:
            self.cost.retime(tokens, seconds)
        else:
            self.cost.observe(tokens, seconds)
        self.timed[rows] = self.steps

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill pass (or a chunk's share of a decode pass) of `tokens` took `seconds`: the next
        chunk is sized from it (engine/prefill.py)."""
        self.last_prefill = (tokens, seconds)

    def ride_share(self, tokens: int, seconds: float) -> float:
        """A riding chunk's share of a decode pass feeding `tokens` tokens that took `seconds`:
        what it added to the rows' usual step."""
        return max(seconds - self.cost.estimate(tokens), 0.0)

    def untimed(self, rows: int) -> int:
        """Steps since `rows` rows last decoded in a pass of their own, counted from the step they
        were first asked about (until then the cost curve's estimate stands for them)."""
        return self.steps - self.timed.setdefault(rows, self.steps)
