"""The batched engine: the only place that knows the order of a decoding step. Each step runs, as
phases over every running row: choose drafts -> build inputs -> ONE target pass -> verify ->
commit (the cache keeps the accepted path) -> propose -> emit. Requests join and leave between
steps (continuous batching); each row has its own draft tree, sampling settings and seeded
generator. Plain decoding is the same step with empty drafts, batch 1 the same step with one row.

Not thread-safe: one thread owns an Engine (the server's engine thread, or generate_tokens).
"""
from __future__ import annotations

import copy
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from quickdraft.cache import KVCache
from quickdraft.engine.events import FinishReason, GenerationStats, TokenEvent, TokenOrigin, token_origins
from quickdraft.engine.inputs import StepInputs, build_inputs, ragged
from quickdraft.engine.policy import POLICIES, PolicyName, RowDraft, StepCost, choose_draft_lengths
from quickdraft.engine.prefill import next_admitted, step_allowance
from quickdraft.errors import ContextTooLong
from quickdraft.grammar import Constraint
from quickdraft.logprobs import TokenLogprob, token_logprobs
from quickdraft.model.llama import Transformer
from quickdraft.prefix_cache import BLOCK, PrefixCache
from quickdraft.sampling import SamplingParams
from quickdraft.draft_contract import MAX_K, NO_DRAFT, Committed, Draft, PassCost, Proposer
from quickdraft.proposers.base import TopTokens, propose_together
from quickdraft.verify import verify

Events = list[tuple[str, TokenEvent]]
OFFER_BLOCKS = 16  # prefix-cache blocks a prompt's K/V are copied in per step (256 tokens: a few ms)
log = logging.getLogger("quickdraft.engine")


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


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    proposer: Proposer | None = None
    k: int = 0                  # draft tokens per step at most (0 = plain decoding)
    adaptive: bool = True       # let the policy verify only the part of a draft that pays off
    constraint: Constraint | None = None  # a grammar the output follows (grammar.py), at every drafted position too
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(eq=False)  # rows are compared by identity: they hold tensors
class _Row:
    request: Request
    budget: int                 # new tokens this row may still produce in all
    stop_ids: frozenset[int]
    generator: torch.Generator
    stats: GenerationStats
    start: float
    length: int = 0             # tokens with K/V in the cache
    last: int = -1              # newest committed token: fed first at the next step
    draft: Draft = NO_DRAFT     # the proposer's offer for the next step
    tokens: list[int] = field(default_factory=list)  # the prompt, then every committed token: the
                                # K/V in the cache are those of tokens[:length]
    features: list[torch.Tensor] = field(default_factory=list)  # [n, D] pieces: the last layer's
                                # outputs at tokens[:length] (kept for the prefix cache only)
    failed: bool = False        # its pass or proposer raised: its K/V are not offered to the prefix cache
    leaving: bool = False       # it ended with K/V not yet all offered to the prefix cache (Engine.ended)

    @property
    def pinned(self) -> bool:
        """Seeded sampling reproduces only if this row's draft lengths depend on nothing outside
        it (step times, other rows): such rows verify the whole draft their proposer offers."""
        p = self.request.params
        return not self.request.adaptive or (not p.greedy and p.seed is not None)


def check_context(prompt_len: int, context: int, note: str = "") -> None:
    """`note`: why the context ends there, where the model says (ModelConfig.context_note)."""
    if prompt_len == 0:
        raise ContextTooLong("the prompt is empty; expected at least one token")
    if prompt_len >= context:
        raise ContextTooLong(
            f"the prompt has {prompt_len} tokens but the context holds {context}{note}; "
            f"expected at most {context - 1} so at least one token can be generated")


def cut_at_stop(new: list[int], stop_ids: frozenset[int], remaining: int) -> tuple[list[int], FinishReason | None]:
    """The tokens to emit out of a step's `new` ones: a stop token or the budget inside an accepted
    run ends generation there and drops what follows."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[:i], "stop"
        if i + 1 >= remaining:
            return new[:i + 1], "length"
    return new, None


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(),
                 cost: StepCost | None = None, cache: KVCache | None = None,
                 prefix: PrefixCache | None = None) -> None:
        """prefix: K/V of earlier requests' tokens (shared with other engines of the same model on
        the same thread): a prompt that starts with them prefills only the rest."""
        self.model = model
        self.config = config
        self.max_seq_len = min(config.max_seq_len or model.config.max_position_embeddings,
                               model.config.max_position_embeddings)
        self.cost = cost or StepCost()
        # Rows of a batch are padded to the longest draft: room for MAX_K slots past the end.
        self.pad = MAX_K if config.max_batch > 1 else 0
        self.grows = cache is None  # a cache of its own grows as requests need (_reserve)
        if cache is None:
            cache = model.new_cache(1, 1)
        elif cache.batch_size != config.max_batch:
            raise ValueError(f"cache has {cache.batch_size} rows, expected max_batch={config.max_batch}")
        else:
            self.max_seq_len = min(self.max_seq_len, cache.max_len - self.pad)
        self.cache = cache
        self.prefix = prefix
        self.invariant_rows = model.invariant_rows  # rows a pass may feed, each row's bits its own (None: any)
        self.last_prefill: tuple[int, float] | None = None  # (tokens, seconds) of the last prefill pass
        self.rows: list[_Row] = []          # row i lives in cache row i: running rows are rows[0:n]
        self.filling: _Row | None = None    # the row whose prompt is being prefilled: cache row n
        self.waiting: list[Request] = []
        self._passed: dict[str, int] = {}  # request id -> admissions it waited through (prefill.next_admitted)
        self.finished: list[_Row] = []       # rows that ended in the last step, freed at the next
        # rows that go on after the last step, with what it committed: their proposers are told
        # and asked for the next draft at the start of the next step, after the step's tokens
        # went out (a draft model's forwards, or its prompt's prefill, delay no emitted token)
        self.to_propose: list[tuple[_Row, Committed]] = []
        self.offering: list[_Row] = []  # decoding rows whose prompts are still being left to the prefix cache
        # an ended row whose K/V are still being left to the prefix cache, OFFER_BLOCKS a step: they
        # lie in the cache row past the running ones (it was the last) until a prompt is admitted there
        self.ended: _Row | None = None

    # -- requests joining and leaving ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; it is admitted at the next step with a free row. Raises ContextTooLong
        for a prompt that cannot fit (nothing is queued then)."""
        check_context(len(request.prompt_ids), self.max_seq_len, self.model.config.context_note(self.max_seq_len))
        if isinstance(request.k, bool) or not isinstance(request.k, int) or not 0 <= request.k <= MAX_K:
            raise ValueError(f"k must be an integer in 0..{MAX_K}, found {request.k!r}")
        self.waiting.append(request)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row is freed now); False if it is not here."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                self._passed.pop(request_id, None)
                return True
        for i, row in enumerate(self.rows):
            if row.request.id == request_id and row not in self.finished:
                self._leave(row, i)
                self._free(i)
                return True
        if self.filling is not None and self.filling.request.id == request_id:
            self.filling = None
            return True
        return False

    @property
    def num_running(self) -> int:
        """Requests holding a row: decoding, or having their prompt prefilled."""
        return len(self.rows) - len(self.finished) + (self.filling is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return self.num_running > 0 or bool(self.waiting)

    def leaving(self) -> bool:
        """An ended row's K/V are still on their way to the prefix cache: steps take them in, a few
        blocks each, requests or none (or the next admission, all at once)."""
        return self.ended is not None or any(row.leaving for row in self.finished)

    def _offer(self, row: _Row, i: int, features: torch.Tensor, max_blocks: int | None = None) -> bool:
        """Leave a row's K/V (cache row i) to the prefix cache, unless its pass failed: its tokens'
        with `features` [n, D]; at most `max_blocks` new blocks now (whether all are in). A cache
        that fails (out of memory) loses only the caching, never the request or the engine."""
        if self.prefix is None or row.failed:
            return True
        try:
            return self.prefix.store(row.tokens, self.cache, i, features, max_blocks)
        except Exception:  # noqa: BLE001
            log.warning("the prefix cache failed to keep a request's K/V; going on without", exc_info=True)
            return True

    def _offer_prompts(self, admitting: Sequence[int] | None = None) -> None:
        """Go on leaving the prompts of rows that started decoding to the prefix cache, OFFER_BLOCKS
        blocks a step each: a long prompt's K/V copied at once stalled every row (4,000 tokens of
        the 1.5B: 254 MB, 6x a decode step). `admitting`: a prompt about to look its prefix up;
        the rows whose prompts start as it does are left whole now (n choices of one request, or
        sessions behind one system prompt, would otherwise prefill again what is not in yet)."""
        for row in list(self.offering):
            shares = admitting is not None and row.tokens[:BLOCK] == list(admitting[:BLOCK])
            if admitting is not None and not shares:
                continue
            if row not in self.rows or row in self.finished or self._offer(
                    row, self.rows.index(row), row.features[0], None if shares else OFFER_BLOCKS):
                self.offering.remove(row)  # offered whole, or gone (an ending row leaves all it holds)

    def _leave(self, row: _Row, i: int, whole: bool = False) -> None:
        """A row that ends (in cache row i) leaves its K/V to the prefix cache: OFFER_BLOCKS blocks
        a step from the next (`ended`: its step has a prompt's offer already, maybe its own) or, where
        rows must move first, all at its _free; `whole`: all now. Leaving a 4,000-token row's K/V at
        once (254 MB of the 1.5B's) stalled every other row ~5 decode steps."""
        if self.prefix is not None and not row.failed:
            row.leaving = not whole or not self._offer(row, i, _features(row))

    def _offer_ended(self, whole: bool = False) -> None:
        """Go on leaving the ended row's K/V (cache row n) to the prefix cache; `whole`: all that is
        left, now (a prompt is about to be admitted into that row, or rows to move)."""
        row = self.ended
        if row is not None and self._offer(row, len(self.rows), _features(row), None if whole else OFFER_BLOCKS):
            self.ended = None

    def _free(self, i: int) -> None:
        """Keep running rows in cache rows 0..n-1 (and the filling row in row n): the last row moves
        into the freed one. A freed row still leaving its K/V stays where it is (the `ended` row)
        if it was the last and no prompt is being filled, else leaves them all now."""
        self._offer_ended(whole=True)
        last, row = len(self.rows) - 1, self.rows[i]
        if row.leaving and (i != last or self.filling is not None):
            self._leave(row, i, whole=True)
        if i != last:
            self.cache.copy_row(last, i, self.rows[last].length)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        if self.filling is not None:
            self.cache.copy_row(last + 1, last, self.filling.length)
        self._sync_cache_lengths()
        if row.leaving:
            self.ended = row

    def _sync_cache_lengths(self) -> None:
        lengths = [row.length for row in self.rows] + ([self.filling.length] if self.filling else [])
        self.cache.truncate(lengths + [0] * (self.cache.batch_size - len(lengths)))

    # -- one step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Events:
        """Give the running rows their drafts (the proposers told what the last step committed),
        decode every running row once (one target pass), then admit and prefill waiting requests
        into free rows. Returns (request id, event) pairs; finished rows are gone. A request whose
        proposer or pass fails ends with finish reason "error"; the others go on (_decode)."""
        events: Events = []
        # what verifying costs the pass these drafts go to: its rows are every running row that
        # has not ended (rows admitted one by one in the last step each saw fewer)
        cost = self._pass_cost([r for r in self.rows if all(r is not f for f in self.finished)])
        going = [(row, replace(step, cost=None if row.pinned else cost))
                 for row, step in self.to_propose if any(r is row for r in self.rows)]  # not cancelled
        self.to_propose = []
        for (row, _), error in zip(going, self._propose(going)):
            if error is None and row.request.constraint is not None:
                error = self._constrain(row)
            if error is not None:  # a failing proposer ends its own request, freed below, before the pass
                events += self._fail(row, error)
        for row in self.finished:
            self._free(self.rows.index(row))
        self.finished = []
        self._offer_prompts()
        self._offer_ended()
        left = None  # prompt tokens this step may still prefill (None: _fill decides)
        if self.rows:
            admitted, ride = self._rider()
            events += admitted
            if ride is not None:
                row, most = ride
                before = row.length
                events += self._decode(0, len(self.rows), ride)
                if self.filling is not row:  # its prompt is in: the rest of the allowance to the next
                    left = max(most - (len(row.request.prompt_ids) - before), 0) if row in self.rows else 0
                elif row.length != before:  # it rode: its chunk was the step's allowance
                    left = 0
            else:
                events += self._decode(0, len(self.rows))
        return events + self._fill(left)

    def _decode(self, lo: int, hi: int, ride: tuple[_Row, int] | None = None) -> Events:
        """One step of rows lo..hi-1 (they sit in cache rows lo..hi-1): the recipe. `ride`: the
        filling row (cache row hi) and at most how many of its prompt tokens ride along in the pass
        (ragged passes only; _rider).

        A pass that raises has committed nothing (its K/V lie past the rows' lengths, the sampled
        rows' generators are rewound), so each half of the rows is decoded again on its own, down
        to single rows (a pass a chunk rode in: the rows again without it, the chunk alone after
        them): a row that fails alone ends with the error. Every other row commits what
        the whole pass would have given it: which rows share a pass changes neither a greedy
        row's tokens nor a seeded one's (its draft sizes are pinned, its generator rewound)."""
        rows = self.rows[lo:hi]
        t0 = time.perf_counter()
        drafts = self._choose_drafts(rows)
        sizes = [1 + len(d.tokens) for d in drafts]
        # a ragged pass feeds each row's tokens, a padded one every row padded to the widest
        fed = sum(sizes) if self.model.ragged else len(rows) * max(sizes)
        if self.invariant_rows is not None and len(rows) > 1 and fed > self.invariant_rows:
            # wider, the pass would give each row other bits than it has alone (and leave them to the
            # prefix cache): halves, each with drafts of its own (the prompt's chunk waits: _fill)
            mid = (lo + hi) // 2
            return self._decode(lo, mid) + self._decode(mid, hi)
        if ride is not None:
            row, most = ride
            size = min(most, len(row.tokens) - row.length, (self.invariant_rows or 1 << 62) - fed)
            ride = (row, size) if size > 0 else None
        rng = [None if r.request.params.greedy else r.generator.get_state() for r in rows]  # greedy: no draws
        try:
            inputs = build_inputs([r.length for r in rows], [r.last for r in rows], drafts, self.model.device)
            logits, hidden, chunk = self._pass(lo, hi, inputs, sizes, ride)  # ONE pass
            verdict = verify(drafts, logits, [r.request.params for r in rows], [r.generator for r in rows],
                             [_masks(r, len(d.tokens)) for r, d in zip(rows, drafts)], [_generated(r) for r in rows])
        except Exception as e:  # noqa: BLE001 - found and reported per row below
            for row, state in zip(rows, rng):
                if state is not None:
                    row.generator.set_state(state)
            if ride is not None:  # the chunk may be what failed: the rows again without it, it in a pass of its own
                return self._decode(lo, hi) + self._prefill_chunk(*ride)
            if len(rows) == 1:
                return self._fail(rows[0], e)
            return self._decode(lo, (lo + hi) // 2) + self._decode((lo + hi) // 2, hi)
        step_s = time.perf_counter() - t0
        if ride is None:  # t(N) of decode passes: a chunk's tokens cost by their context too (prefill.py)
            self.cost.observe(sum(sizes), step_s)
        steps, origins, logprobs = [], [], []
        top = TopTokens(logits, sizes)  # made only if a proposer asks
        for b, (row, draft, kept, tokens) in enumerate(zip(rows, drafts, verdict.kept, verdict.tokens)):
            # commit: the accepted path's K/V move into place; the rest is evicted (a length change)
            self.cache.compact(lo + b, row.length + 1, [row.length + 1 + i for i in kept])
            row.length += 1 + len(kept)
            row.tokens += tokens
            row.stats.record_draft(draft.depths(), len(kept))
            steps.append(Committed(tokens, len(kept), len(draft.tokens), hidden[b, [0, *(1 + i for i in kept)]],
                                   top.row(b)))
            if self.prefix is not None:
                row.features.append(steps[-1].features)
            origins.append(token_origins(draft.tree, kept, draft.source))
            logprobs.append(_logprobs(row, logits[b], kept, tokens))
        events = self._emit(rows, steps, step_s, origins, logprobs)
        if ride is None:
            return events
        # the chunk's share of the pass: what it added to the decode rows' usual step
        extra = max(step_s - self.cost.estimate(sum(sizes)), 0.0)
        return events + self._prefilled(ride[0], ride[1], chunk, extra)

    def _pass(self, lo: int, hi: int, inputs: StepInputs, sizes: list[int], ride: tuple[_Row, int] | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target's pass over rows lo..hi-1 -> logits [B, 1+W, V], hidden [B, 1+W, D] (padding's
        are junk) and the riding chunk's hidden [n, D] (None: no chunk). Ragged where the model
        feeds them: each row's tokens only, and the chunk's, in one sequence (inputs.ragged)."""
        if not self.model.ragged:
            out = self.model(inputs.ids, inputs.positions, self.cache.rows(lo, hi), inputs.mask, inputs.width,
                             inputs.slots)
            return out.logits, out.hidden, None
        chunk = None if ride is None else (ride[0].length, ride[0].tokens[ride[0].length:ride[0].length + ride[1]])
        flat = ragged(inputs, sizes, chunk)
        out = self.model(flat.ids, flat.positions, self.cache.rows(lo, hi + (ride is not None)), flat.mask,
                         last_n=0, slots=flat.slots, rows=flat.rows)
        hidden = out.hidden[0]  # [M, D]
        logits = self.model.logits(hidden[:flat.decoded])  # the chunk's only where it ends a prompt: _prefilled
        chunk = None if ride is None else hidden[flat.decoded:]
        if len(set(sizes)) == 1:  # no padding: the rows' tokens are already in StepInputs' places
            return logits.view(len(sizes), sizes[0], -1), hidden[:flat.decoded].view(len(sizes), sizes[0], -1), chunk
        return logits[flat.index], hidden[flat.index], chunk

    def _choose_drafts(self, rows: list[_Row]) -> list[Draft]:
        """The part of each row's offered draft to verify (engine/policy.py)."""
        sizes = choose_draft_lengths([RowDraft.of(r.draft, r.pinned)
                                      for r in rows], self.cost, self.config.policy, self.config.max_step_tokens)
        return [r.draft.prefix(n) for r, n in zip(rows, sizes)]

    def _pass_cost(self, rows: Sequence[_Row]) -> PassCost | None:
        """What verification will cost these rows' next step, for proposers that pay to draft
        (None under the fixed policy: every draft is verified whole, so its length must not
        depend on timing). The marginal cost is t(N)'s slope up to the drafts the rows may offer."""
        if self.config.policy == "fixed":
            return None
        n = len(rows)
        extra = max(1, min(sum(r.request.k for r in rows), (self.config.max_step_tokens or MAX_K * n) - n))
        base = self.cost.estimate(n)
        return PassCost(base, max(self.cost.estimate(n + extra) - base, 0.0) / extra, n)

    def _start_row(self, request: Request) -> _Row:
        params = request.params
        budget = min(params.max_new_tokens, self.max_seq_len - len(request.prompt_ids))
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else request.eos_token_ids)
        return _Row(request, budget, stop_ids, params.make_generator(self.model.device),
                    GenerationStats(prompt_tokens=len(request.prompt_ids)), time.perf_counter())

    def _rider(self) -> tuple[Events, tuple[_Row, int] | None]:
        """The prompt whose next tokens ride along with this step's decode pass (ragged passes
        only), admitted now if none is being prefilled, and at most how many tokens: as many as
        stall the decoding rows little (engine/prefill.py). Events: admissions that failed."""
        if not self.model.ragged:
            return [], None
        events: Events = []
        while self.filling is None and self.waiting and len(self.rows) < self.config.max_batch:
            events += self._take_waiting()
        if self.filling is None:
            return events, None
        return events, (self.filling, step_allowance(len(self.rows), self.cost, self.last_prefill,
                                                     self.config.prefill_chunk))

    def _take_waiting(self) -> Events:
        """Admit the next waiting request into the filling row; its error event if that fails."""
        request = self._next_waiting()
        try:
            self.filling = self._admit(request)
        except Exception as e:  # noqa: BLE001 - growing the cache (out of memory): this request ends
            return [(request.id, TokenEvent([], "error", GenerationStats(prompt_tokens=len(request.prompt_ids)), e))]
        return []

    def _fill(self, allowance: int | None = None) -> Events:
        """Admit waiting requests into free rows and prefill their prompts, one row at a time: while
        rows decode, only as many prompt tokens a step as stall them little (engine/prefill.py), in
        the decode pass where they can ride along (`allowance`: what that left), else in passes of
        their own; while none decodes, whole prompts. A prompt's passes draft nothing, exactly like
        plain decoding."""
        events: Events = []
        # allowance: prompt tokens this step may still feed (None: as yet unlimited)
        while allowance != 0:
            if self.filling is None:
                if not self.waiting or len(self.rows) >= self.config.max_batch:
                    break
                events += self._take_waiting()
                continue
            if allowance is None and (self.rows or self.config.prefill_chunk):
                allowance = step_allowance(len(self.rows), self.cost, self.last_prefill, self.config.prefill_chunk)
            row = self.filling
            size = min(len(row.tokens) - row.length, allowance or 1 << 62, self.invariant_rows or 1 << 62)
            events += self._prefill_chunk(row, size)
            allowance = None if allowance is None else allowance - size
        return events

    def _next_waiting(self) -> Request:
        """Take the waiting request to admit now (engine/prefill.py: shortest remaining prefill first,
        none passed over forever)."""
        limit = [len(r.prompt_ids) - 1 for r in self.waiting]  # the last prompt token is always fed
        left = [len(r.prompt_ids) - (self.prefix.hit(r.prompt_ids, n) if self.prefix is not None else 0)
                for r, n in zip(self.waiting, limit)]
        i = next_admitted(left, [self._passed.get(r.id, 0) for r in self.waiting])
        for earlier in self.waiting[:i]:
            self._passed[earlier.id] = self._passed.get(earlier.id, 0) + 1
        request = self.waiting.pop(i)
        self._passed.pop(request.id, None)
        return request

    def _admit(self, request: Request) -> _Row:
        """A row for `request` in cache row n, holding the K/V of the longest prefix of its prompt
        that the prefix cache has (its last token is always fed: its logits give the first token)."""
        self._offer_ended(whole=True)  # its K/V lie where this row goes
        row = self._start_row(request)
        row.tokens = list(request.prompt_ids)
        self._reserve(len(self.rows) + 1, len(row.tokens) + row.budget + self.pad)
        if self.prefix is not None:
            self._offer_prompts(row.tokens)
            try:
                features = self.prefix.fetch(row.tokens, len(row.tokens) - 1, self.cache, len(self.rows))
            except Exception:  # noqa: BLE001 - out of memory, say: a miss, the prompt is prefilled whole
                log.warning("the prefix cache failed to give a prompt's K/V; prefilling it whole", exc_info=True)
                features = None
            if features is not None:
                row.features = [features]
                row.length = row.stats.cached_tokens = features.shape[0]
        return row

    def _reserve(self, rows: int, length: int) -> None:
        """A cache of our own holds `rows` rows of `length` slots: grown by doubling (each growth
        copies what it holds), never past max_batch rows of max_seq_len (+ pad) slots."""
        have = self.cache
        if not self.grows or (rows <= have.batch_size and length <= have.max_len):
            return
        rows = max(rows, 2 * have.batch_size) if rows > have.batch_size else rows
        length = max(length, 2 * have.max_len) if length > have.max_len else length
        have.reserve(min(rows, self.config.max_batch), min(length, self.max_seq_len + self.pad))

    def _prefill_chunk(self, row: _Row, size: int) -> Events:
        """Feed the next `size` tokens of the filling row's prompt; after the last, it decodes from
        the next step on (it joins the running rows, whose cache row it already sits in)."""
        index, end, device = len(self.rows), row.length + size, self.model.device
        t0 = time.perf_counter()
        try:
            out = self.model(torch.tensor([row.tokens[row.length:end]], device=device),
                             torch.arange(row.length, end, device=device)[None], self.cache.rows(index, index + 1),
                             last_n=0)
        except Exception as e:  # noqa: BLE001 - only this row ran: only this request ends
            return self._fill_failed(row, e)
        return self._prefilled(row, size, out.hidden[0], time.perf_counter() - t0)

    def _prefilled(self, row: _Row, size: int, hidden: torch.Tensor, seconds: float) -> Events:
        """The filling row's next `size` prompt tokens went through the model (their K/V are in its
        cache row; hidden [size, D]), in a pass of their own or riding along, adding `seconds` to
        the step. After the prompt's last token, the row decodes from the next step on (it joins
        the running rows, whose cache row it already sits in); its first token is sampled here from
        that token's logits alone, as a one-pass prefill scores it."""
        index, n, end = len(self.rows), len(row.tokens), row.length + size
        self.last_prefill = (size, seconds)
        row.length = end
        row.features.append(hidden)
        if end < n:
            row.stats.verify_s += seconds
            return []
        try:
            logits = self.model.logits(hidden[-1:])[None]  # [1, 1, V]
            verdict = verify([NO_DRAFT], logits, [row.request.params], [row.generator], [_masks(row, 0)])
        except Exception as e:  # noqa: BLE001 - only this row's: only this request ends
            return self._fill_failed(row, e)
        self.filling = None
        self.rows.append(row)
        features = torch.cat(row.features)  # [n, D]: the whole prompt's, as a one-pass prefill gives them
        row.features = [features] if self.prefix is not None else []
        if not self._offer(row, index, features, OFFER_BLOCKS):  # now: sessions that share this prompt
            self.offering.append(row)                             # need not wait for its end
        row.tokens += verdict.tokens[0]
        step = Committed(verdict.tokens[0], 0, 0, features, TopTokens(logits, [1]).row(0))
        return self._emit([row], [step], seconds, [[TokenOrigin("target", 0)]],
                          [_logprobs(row, logits[0], [], verdict.tokens[0])])

    def _fill_failed(self, row: _Row, error: Exception) -> Events:
        """The filling row's prompt pass raised: only its request ends."""
        self.filling = None
        row.stats.total_s = time.perf_counter() - row.start
        return [(row.request.id, TokenEvent([], "error", copy.deepcopy(row.stats), error))]

    def _fail(self, row: _Row, error: Exception) -> Events:
        """End one request with the error its own pass raised; its row is freed at the next step."""
        row.stats.total_s = time.perf_counter() - row.start
        row.failed = True
        self.finished.append(row)
        return [(row.request.id, TokenEvent([], "error", copy.deepcopy(row.stats), error))]

    def _emit(self, rows: list[_Row], steps: Sequence[Committed], step_s: float,
              origins: Sequence[list[TokenOrigin]], logprobs: Sequence[list[TokenLogprob]]) -> Events:
        """The step's last phases over its rows: cut each row's new tokens at a stop token or its
        budget; events (origins: per row, where each of its step's tokens came from; logprobs:
        theirs, for rows that ask). The rows that go on tell their proposers and get their next
        drafts when the next step starts."""
        cuts = [self._cut(row, step, step_s) for row, step in zip(rows, steps)]
        self.to_propose += [(row, step) for row, step, (_, finish) in zip(rows, steps, cuts) if finish is None]
        events, finished = [], []
        for row, (emitted, finish), origin, logprob in zip(rows, cuts, origins, logprobs):
            stats = row.stats
            stats.total_s = time.perf_counter() - row.start
            if stats.ttft_s == 0.0 and (emitted or finish):
                stats.ttft_s = stats.total_s
            events.append((row.request.id, TokenEvent(emitted, finish, copy.deepcopy(stats), None,
                                                      origin[:len(emitted)], logprob[:len(emitted)])))
            if finish:
                finished.append(row)
                self._leave(row, self.rows.index(row))
        self.finished += finished  # freed at the next step: until then the cache shows their tokens
        self._sync_cache_lengths()
        return events

    @staticmethod
    def _cut(row: _Row, step: Committed, step_s: float) -> tuple[list[int], FinishReason | None]:
        """The tokens of `step` to emit and why the row ends, if it does; counts them."""
        stats = row.stats
        stats.target_passes += 1
        stats.verify_s += step_s
        emitted, finish = cut_at_stop(step.tokens, row.stop_ids, row.budget - stats.new_tokens)
        if finish == "stop":  # drafts accepted after the stop token leave the cache too
            row.length -= step.drafted - len(emitted)
        stats.new_tokens += len(emitted)
        stats.committed_tokens += len(emitted) + (finish == "stop" and len(emitted) < len(step.tokens))
        row.last = step.tokens[-1]
        if row.request.constraint is not None:  # a grammar complete, or at a dead end, ends it too
            finish = row.request.constraint.advance(emitted) or finish
        return emitted, finish

    @staticmethod
    def _constrain(row: _Row) -> Exception | None:
        """The row's grammar shapes its next draft: forced tokens first, then the proposer's, cut at
        the first token the grammar forbids (grammar.py)."""
        request, t0 = row.request, time.perf_counter()
        offered = row.draft if request.proposer is not None and request.k else NO_DRAFT
        try:
            row.draft = request.constraint.shape(offered, min(request.k, row.budget - row.stats.new_tokens - 1))
        except Exception as e:  # noqa: BLE001 - ends that request only
            return e
        finally:
            row.stats.propose_s += time.perf_counter() - t0
        return None

    @staticmethod
    def _propose(going: Sequence[tuple[_Row, Committed]]) -> list[Exception | None]:
        """Each row's proposer is told its step, then asked for the next draft: the rows whose
        proposers share a group in one call (a draft model's forwards for all of them at once,
        proposers/base.py). A failing proposer ends its own request, never the batch."""
        errors: list[Exception | None] = [None] * len(going)
        asking: list[int] = []
        for i, (row, step) in enumerate(going):
            proposer = row.request.proposer
            if proposer is None or row.request.k == 0:
                continue
            t0 = time.perf_counter()
            try:
                proposer.commit(step if row.request.constraint is None else row.request.constraint.translate(step))
                asking.append(i)
            except Exception as e:  # noqa: BLE001 - reported to that request's consumer
                errors[i] = e
            row.stats.propose_s += time.perf_counter() - t0
        rows = [going[i][0] for i in asking]
        proposals = propose_together([row.request.proposer for row in rows],
                                     [min(row.request.k, row.budget - row.stats.new_tokens - 1) for row in rows])
        for i, row, proposal in zip(asking, rows, proposals):
            row.stats.propose_s += proposal.seconds
            row.draft, errors[i] = proposal.draft, proposal.error
        return errors


def _features(row: _Row) -> torch.Tensor:
    """The row's features [length, D], in one piece from now on (an ended row's, offered in parts)."""
    if row.features[0].shape[0] < row.length:
        row.features = [torch.cat(row.features)]
    return row.features[0][:row.length]


def _generated(row: _Row) -> list[int] | None:
    """The tokens the row generated so far, where its penalties count them (None: it has none)."""
    return row.tokens[len(row.request.prompt_ids):] if row.request.params.penalized else None


def _logprobs(row: _Row, logits: torch.Tensor, kept: list[int], tokens: list[int]) -> list[TokenLogprob]:
    """The log-probabilities of a step's committed `tokens` for a row that asks (logprobs.py), from
    the pass's logits [1+W, V] where each was scored: the root's, then each kept node's; else []."""
    top = row.request.params.logprobs
    return [] if top is None else token_logprobs(logits[[0, *(1 + i for i in kept)]], tokens, top)


def _masks(row: _Row, n: int) -> torch.Tensor | None:
    """The grammar's allowed tokens [1+n, V] at the row's root and its draft's first n nodes (None: no grammar)."""
    constraint = row.request.constraint
    return None if constraint is None else constraint.masks(n, row.generator.device)
