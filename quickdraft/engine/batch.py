"""The batched engine: the only place that knows the order of a decoding step. Each step runs, as
phases over every running row: the proposers told what the last step committed and asked for
their drafts -> rows that ended freed -> where passes are ragged, a waiting request admitted into
the free row so that its prompt's next chunk rides along -> choose draft lengths -> build inputs ->
ONE target pass -> verify -> commit (the cache keeps the accepted path) -> emit; then what the
step's prefill allowance leaves goes to prompts in passes of their own. Requests join and leave
between steps (continuous batching); each row has its own draft tree, sampling settings and seeded
generator. Plain decoding is the same step with empty drafts, batch 1 the same step with one row.

What a step does is decided by the scheduler (engine/scheduler.py: admissions, prefill allowances,
draft lengths, passes split to stay batch invariant), from numbers the engine reports back; the
engine runs the passes. Its parts, each an object it holds: where rows live in the cache and how
their K/V leave (engine/placement.py), admission and prefill (engine/admission.py); the rows and
requests they share: engine/rows.py.

Not thread-safe: one thread owns an Engine (the server's engine thread, or generate_tokens).
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Sequence

import torch

from quickdraft.engine.admission import Admission
from quickdraft.engine.events import FinishReason, TokenEvent, TokenOrigin, token_origins
from quickdraft.engine.inputs import StepInputs, build_inputs, ragged
from quickdraft.engine.placement import Placement
from quickdraft.engine.policy import RowDraft, StepCost
from quickdraft.engine.rows import (
    Events,
    Request,
    Row,
    check_context,
    cut_at_stop,
    generated_tokens,
    grammar_masks,
    release_proposer,
    step_logprobs,
)
from quickdraft.engine.scheduler import DecodePlan, EngineConfig, Scheduler
from quickdraft.engine.scores import Scores, verify_scored
from quickdraft.kv.cache import KVCache
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, Outcome, TopTokens, together
from quickdraft.spec.draft_contract import MAX_K, NO_DRAFT, Committed, ProposerGroup, attempt
from quickdraft.spec.logprobs import TokenLogprob

__all__ = ["Engine", "EngineConfig", "Request", "check_context", "cut_at_stop"]


class Engine:
    """Orders the phases into a step: the scheduler decides (engine/scheduler.py), the placement
    keeps the rows in the cache (engine/placement.py), admission prefills prompts
    (engine/admission.py), this class runs the decode pass, verifies, commits and emits."""
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
        self.scheduler = Scheduler(config, self.cost, model.invariant_rows, model.ragged)
        # Rows of a batch are padded to the longest draft: room for MAX_K slots past the end.
        self.pad = MAX_K if config.max_batch > 1 else 0
        if prefix is not None and (prefix.pool.device, prefix.pool.dtype) != (model.device, model.compute_dtype):
            raise ValueError(f"the prefix cache's blocks are {prefix.pool.dtype} on {prefix.pool.device}, the model's "
                             f"K/V {model.compute_dtype} on {model.device}: give the cache a BlockPool of the model's")
        if prefix is not None and prefix.features and prefix.feature_width != model.feature_width:
            raise ValueError(f"the prefix cache keeps {prefix.feature_width} features per token, the model hands over "
                             f"{model.feature_width} (its feature_layers): make the cache with the model's feature_width")
        grows = cache is None  # a cache of its own grows as requests need (Placement.reserve)
        if cache is None:  # rows in the prefix cache's pool: a hit shares its blocks
            cache = model.new_cache(1, 1) if prefix is None else KVCache(prefix.pool, 1, 1)
        elif cache.batch_size != config.max_batch:
            raise ValueError(f"cache has {cache.batch_size} rows, expected max_batch={config.max_batch}")
        else:
            self.max_seq_len = min(self.max_seq_len, cache.max_len - self.pad)
        self.cache = cache
        self.prefix = prefix
        self.placement = Placement(cache, prefix, grows, self.pad, config.max_batch, self.max_seq_len)
        self.admission = Admission(model, self.placement, self.scheduler, self._emit)
        self.finished: list[Row] = []       # rows that ended in the last step, freed at the next
        # rows that go on after the last step, with what it committed: their proposers are told
        # and asked for the next draft at the start of the next step, after the step's tokens
        # went out (a draft model's forwards, or its prompt's prefill, delay no emitted token)
        self.to_propose: list[tuple[Row, Committed]] = []

    @property
    def rows(self) -> list[Row]:
        """The decoding rows; row i lives in cache row i (placement.py)."""
        return self.placement.rows

    @property
    def filling(self) -> Row | None:
        """The row whose prompt is being prefilled, in cache row n."""
        return self.placement.filling

    # -- requests joining and leaving ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; it is admitted at the next step with a free row. Raises ContextTooLong
        for a prompt that cannot fit (nothing is queued then)."""
        check_context(len(request.prompt_ids), self.max_seq_len, self.model.config.context_note(self.max_seq_len))
        if isinstance(request.k, bool) or not isinstance(request.k, int) or not 0 <= request.k <= MAX_K:
            raise ValueError(f"k must be an integer in 0..{MAX_K}, found {request.k!r}")
        self.scheduler.add(request)

    def close(self, blocks: bool = True) -> None:
        """The engine goes (a caller left early, a model's engine set up anew): every request it
        holds lets go of its proposer's state now (a draft model's row), and with `blocks` its rows'
        blocks go back to the pool (else the cache stays as it is, for a caller that reads it)."""
        for request in [*(row.request for row in self.held()), *self.waiting]:
            release_proposer(request)  # (one released before, at its end, holds nothing: a no-op)
        if blocks:
            self.cache.release_all()

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row is freed now); False if it is not here."""
        waiting = self.scheduler.cancel(request_id)
        if waiting is not None:
            release_proposer(waiting)
            return True
        row = self.row_of(request_id)
        if row is None:
            return False
        release_proposer(row.request)
        if row is self.filling:
            self.placement.drop_filling()
        else:
            i = self.rows.index(row)
            self.placement.leave(row, i)
            self.placement.free(i)
        return True

    def held(self) -> list[Row]:
        """The rows requests hold: the decoding ones (not those that ended in the last step), then
        the filling one."""
        return [*(r for r in self.rows if r not in self.finished), *([self.filling] if self.filling else [])]

    def row_of(self, request_id: str) -> Row | None:
        """The row request `request_id` holds, None where it holds none (waiting, ended, unknown)."""
        return next((r for r in self.held() if r.request.id == request_id), None)

    @property
    def num_running(self) -> int:
        """Requests holding a row: decoding, or having their prompt prefilled."""
        return len(self.held())

    @property
    def waiting(self) -> list[Request]:
        """Requests not yet admitted, in arrival order."""
        return self.scheduler.waiting

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return self.num_running > 0 or bool(self.waiting)

    # -- one step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Events:
        """Give the running rows their drafts (the proposers told what the last step committed),
        decode every running row once (one target pass, a prompt's chunk riding in it where passes
        are ragged: its request admitted first), then admit and prefill waiting requests into free
        rows in passes of their own, as far as the step's allowance goes. Returns (request id, event) pairs; finished rows are gone. A request whose
        proposer or pass fails ends with finish reason "error"; the others go on (_decode)."""
        self.scheduler.begin_step()
        events: Events = []
        # what verifying costs the pass these drafts go to: its rows are every running row that
        # has not ended (rows admitted one by one in the last step each saw fewer)
        cost = self.scheduler.pass_cost([r.request.k for r in self.rows if all(r is not f for f in self.finished)])
        going = [(row, replace(step, cost=None if row.pinned else cost))
                 for row, step in self.to_propose if any(r is row for r in self.rows)]  # not cancelled
        self.to_propose = []
        for (row, _), error in zip(going, self._propose(going)):
            if error is None and row.request.constraint is not None:
                error = self._constrain(row)
            if error is not None:  # a failing proposer ends its own request, freed below, before the pass
                events += self._fail(row, error)
        for row in self.finished:
            self.placement.free(self.rows.index(row))
        self.finished = []
        if self.rows:
            admitted, ride = self.admission.rider()
            events += admitted
            before = None if ride is None else ride[0].length
            events += self._decode(0, len(self.rows), ride)
            if ride is not None:
                row = ride[0]
                if any(r is row for r in self.rows):  # its prompt is in: the rest of the room to the next
                    self.scheduler.spend(len(row.request.prompt_ids) - before)
                elif row is not self.filling or row.length != before:  # it failed, or it rode and goes on
                    self.scheduler.close()
        return events + self.admission.fill()

    def _decode(self, lo: int, hi: int, ride: tuple[Row, int] | None = None) -> Events:
        """One step of rows lo..hi-1 (they sit in cache rows lo..hi-1), in the passes the scheduler
        plans: one, or halves where the rows would not fit a batch-invariant pass (wider, it would
        give each row other bits than it has alone, and leave them to the prefix cache). `ride`: the
        filling row (cache row hi) and at most how many of its prompt tokens ride along (ragged
        passes only; Admission.rider)."""
        rows = self.rows[lo:hi]
        passes = self.scheduler.plan_step([RowDraft.of(r.draft, r.pinned) for r in rows],
                                          None if ride is None else (len(ride[0].tokens) - ride[0].length, ride[1]))
        return [e for p in passes for e in self._run(lo + p.lo, lo + p.hi, p.plan,
                                                     (ride[0], p.plan.ride) if ride and p.plan.ride else None)]

    def _run(self, lo: int, hi: int, plan: DecodePlan, ride: tuple[Row, int] | None) -> Events:
        """One pass over rows lo..hi-1 as `plan` says, the recipe: inputs, the pass, verify, commit,
        emit. `ride`: the filling row and the prompt tokens that ride along.

        A pass that raises has committed nothing (its K/V lie past the rows' lengths, the sampled
        rows' generators are rewound), so each half of the rows is decoded again on its own, down
        to single rows (a pass a chunk rode in: the rows again without it, the chunk alone after
        them): a row that fails alone ends with the error. Every other row commits what
        the whole pass would have given it: which rows share a pass changes neither a greedy
        row's tokens nor a seeded one's (its draft sizes are pinned, its generator rewound)."""
        rows = self.rows[lo:hi]
        t0 = time.perf_counter()
        drafts = [r.draft.prefix(n) for r, n in zip(rows, plan.lengths)]
        sizes = [1 + n for n in plan.lengths]
        rng = [None if r.request.params.greedy else r.generator.get_state() for r in rows]  # greedy: no draws
        try:
            inputs = build_inputs([r.length for r in rows], [r.last for r in rows], drafts, self.model.device)
            scores, features, chunk = self._pass(lo, hi, inputs, sizes, ride)  # ONE pass
            scores.score({b: range(m) for b, m in enumerate(plan.scored)})
            verdict = verify_scored(drafts, scores, [r.request.params for r in rows], [r.generator for r in rows],
                                    [grammar_masks(r, len(d.tokens)) for r, d in zip(rows, drafts)],
                                    [generated_tokens(r) for r in rows])
        except Exception as e:  # noqa: BLE001 - found and reported per row below
            for row, state in zip(rows, rng):
                if state is not None:
                    row.generator.set_state(state)
            if ride is not None:  # the chunk may be what failed: the rows again without it, it in a pass of its own
                return self._decode(lo, hi) + self.admission.prefill_chunk(*ride)
            if len(rows) == 1:
                return self._fail(rows[0], e)
            return self._decode(lo, (lo + hi) // 2) + self._decode((lo + hi) // 2, hi)
        step_s = time.perf_counter() - t0
        self.scheduler.decoded(len(rows), sum(sizes), step_s, riding=ride is not None)
        steps, origins, logprobs = [], [], []
        top = TopTokens(scores.complete, sizes)  # made only if a proposer asks
        for b, (row, draft, kept, tokens) in enumerate(zip(rows, drafts, verdict.kept, verdict.tokens)):
            # commit: the accepted path's K/V move into place; the rest is evicted (a length change)
            self.cache.compact(lo + b, row.length + 1, [row.length + 1 + i for i in kept])
            row.length += 1 + len(kept)
            row.tokens += tokens
            row.stats.record_draft(draft.depths(), len(kept))
            steps.append(Committed(tokens, len(kept), len(draft.tokens), features[b, [0, *(1 + i for i in kept)]],
                                   top.row(b)))
            if self.prefix is not None:
                row.features.append(steps[-1].features)
            origins.append(token_origins(draft.tree, kept, draft.source))
            logprobs.append(step_logprobs(row, scores.logits[b], kept, tokens))
        events = self._emit(rows, steps, step_s, origins, logprobs)
        if ride is None:
            return events
        return events + self.admission.prefilled(ride[0], ride[1], chunk, self.scheduler.ride_share(sum(sizes), step_s))

    def _pass(self, lo: int, hi: int, inputs: StepInputs, sizes: list[int], ride: tuple[Row, int] | None
              ) -> tuple[Scores, torch.Tensor, torch.Tensor | None]:
        """The target's layers over rows lo..hi-1 -> the rows' logits, scored as verification asks
        (engine/scores.py), features [B, 1+W, F] (padding's are junk) and the riding chunk's features
        [n, F] (None: no chunk). Ragged where the model feeds them: each row's tokens only, and the
        chunk's, in one sequence (inputs.ragged)."""
        if not self.model.ragged:
            features = self.model(inputs.ids, inputs.positions, self.cache.rows(lo, hi), inputs.mask, 0,
                                  inputs.slots).features
            return Scores(self.model.logits, features.flatten(0, 1), None, sizes), features, None
        chunk = None if ride is None else (ride[0].length, ride[0].tokens[ride[0].length:ride[0].length + ride[1]])
        flat = ragged(inputs, sizes, chunk)
        out = self.model(flat.ids, flat.positions, self.cache.rows(lo, hi + (ride is not None)), flat.mask,
                         last_n=0, slots=flat.slots, rows=flat.rows)
        features = out.features[0]  # [M, F]
        chunk = None if ride is None else features[flat.decoded:]  # its logits only where it ends a prompt: Admission.prefilled
        decoded = features[:flat.decoded]
        # no padding: the rows' tokens are already in StepInputs' places
        index = None if len(set(sizes)) == 1 else flat.index
        rows = decoded.view(len(sizes), sizes[0], -1) if index is None else features[index]
        return Scores(self.model.logits, decoded, index, sizes), rows, chunk

    def _fail(self, row: Row, error: Exception) -> Events:
        """End one request with the error its own pass raised; its row is freed at the next step."""
        row.stats.total_s = time.perf_counter() - row.start
        row.failed = True
        self.finished.append(row)
        release_proposer(row.request)
        return [(row.request.id, TokenEvent([], "error", row.stats.snapshot(), error))]

    def _emit(self, rows: list[Row], steps: Sequence[Committed], step_s: float,
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
            events.append((row.request.id, TokenEvent(emitted, finish, stats.snapshot(), None,
                                                      origin[:len(emitted)], logprob[:len(emitted)])))
            if finish:
                finished.append(row)
                release_proposer(row.request)  # asked for no draft again: its group's state for it goes now
                self.placement.leave(row, self.rows.index(row))
        self.finished += finished  # freed at the next step: until then the cache shows their tokens
        self.placement.sync_lengths()
        return events

    @staticmethod
    def _cut(row: Row, step: Committed, step_s: float) -> tuple[list[int], FinishReason | None]:
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
    def _constrain(row: Row) -> Exception | None:
        """The row's grammar shapes its next draft: forced tokens first, then the proposer's, cut at
        the first token the grammar forbids (grammar.py)."""
        request, t0 = row.request, time.perf_counter()
        offered = row.draft if request.proposer is not None and request.k else NO_DRAFT
        try:
            row.draft = request.constraint.shape(offered, row.draft_budget)
        except Exception as e:  # noqa: BLE001 - ends that request only
            return e
        finally:
            row.stats.propose_s += time.perf_counter() - t0
        return None

    @staticmethod
    def _propose(going: Sequence[tuple[Row, Committed]]) -> list[Exception | None]:
        """The rows' proposers by group (draft_contract.ProposerGroup): every group told its
        members' steps, then every group asked for their next drafts, one call each (a draft
        model's forwards for all its rows at once), its time shared by its members. A failing
        proposer ends its own request, never the batch (proposers/base.py: together)."""
        errors: list[Exception | None] = [None] * len(going)
        steps: dict[int, tuple[ProposerGroup, dict[int, Committed]]] = {}  # id(group) -> it, index into going -> step
        for i, (row, step) in enumerate(going):
            request = row.request
            if request.proposer is None or request.k == 0:
                continue
            # a grammar's rows: the tokens as the proposer knows them
            told = step if request.constraint is None else attempt(partial(request.constraint.translate, step))
            if isinstance(told, Exception):
                errors[i] = told
            else:
                group = request.proposer.group or EACH  # None: it drafts alone (what None always meant)
                steps.setdefault(id(group), (group, {}))[1][i] = told

        def call(group: ProposerGroup, members: Sequence[int], ask: str, args: Sequence) -> list[Outcome]:
            """The group's `ask` call for going[i] of members, each one's time and failure noted."""
            proposers = [going[i][0].request.proposer for i in members]
            outcomes = together(getattr(group, ask), proposers, args)
            for i, outcome in zip(members, outcomes):
                going[i][0].stats.propose_s += outcome.seconds
                errors[i] = outcome.error
            return outcomes

        asking: list[tuple[ProposerGroup, list[int]]] = []  # per group, the members that took their steps:
        for group, told in steps.values():                  # all told before any is asked
            members = list(told)
            asking.append((group, [i for i, outcome in zip(members, call(group, members, "commit", list(told.values())))
                                   if outcome.error is None]))
        for group, members in asking:
            if not members:
                continue
            rows = [going[i][0] for i in members]
            for row, outcome in zip(rows, call(group, members, "propose", [row.draft_budget for row in rows])):
                row.draft = NO_DRAFT if outcome.error is not None else outcome.value
        return errors

