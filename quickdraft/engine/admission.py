"""The engine's admission and prefill: the waiting request the scheduler picks takes the free row,
its cached prefix shared in, its prompt fed in chunks (riding along with the decode pass where the
model feeds ragged passes) and scored where it asks, its first token sampled and emitted as the
engine emits every step's (`emit`). Who goes next and how many tokens a step may prefill are the
scheduler's (engine/scheduler.py); where rows live, the placement's (engine/placement.py).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from quickdraft.engine.events import GenerationStats, TokenEvent, TokenOrigin
from quickdraft.engine.placement import Placement
from quickdraft.engine.rows import Events, Request, Row, grammar_masks, release_proposer, step_logprobs
from quickdraft.engine.scheduler import Scheduler
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import TopTokens
from quickdraft.spec.draft_contract import NO_DRAFT, Committed
from quickdraft.spec.logprobs import TokenLogprob, token_logprobs
from quickdraft.spec.verify import verify

# The engine's last phases over rows that committed a step (Engine._emit): (rows, steps, seconds,
# each one's token origins, each one's logprobs) -> events
Emit = Callable[[list[Row], Sequence[Committed], float, Sequence[list[TokenOrigin]], Sequence[list[TokenLogprob]]],
                Events]
SCORE_ROWS = 64  # prompt positions the LM head scores at a time where any count is batch invariant: bounds
                 # the [rows, V] logits held (a 4,000-token prompt's at once: 800 MB of SmolLM2's)


class Admission:
    def __init__(self, model: Transformer, placement: Placement, scheduler: Scheduler, emit: Emit) -> None:
        self.model, self.placement, self.scheduler, self.emit = model, placement, scheduler, emit
        self.invariant_rows = model.invariant_rows

    def _start_row(self, request: Request) -> Row:
        params = request.params
        budget = min(params.max_new_tokens, self.placement.max_seq_len - len(request.prompt_ids))
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else request.eos_token_ids)
        return Row(request, budget, stop_ids, params.make_generator(self.model.device),
                    GenerationStats(prompt_tokens=len(request.prompt_ids)), time.perf_counter())

    def rider(self) -> tuple[Events, tuple[Row, int] | None]:
        """The prompt whose next tokens ride along with this step's decode pass (ragged passes
        only), admitted now if none is being prefilled, and at most how many tokens: the step's
        prefill room (the scheduler's: as many as stall the decoding rows little). Events:
        admissions that failed."""
        if not self.model.ragged:
            return [], None
        events: Events = []
        place = self.placement
        while place.filling is None and self.scheduler.admits(len(place.rows)):
            events += self._take_waiting()
        if place.filling is None:
            return events, None
        room = self.scheduler.prefill_room(len(place.rows), riding=True)
        assert room is not None, "rows decode, so the room has a limit"
        return events, (place.filling, room)

    def _take_waiting(self) -> Events:
        """Admit the next waiting request into the filling row; its error event if that fails."""
        request = self._next_waiting()
        try:
            self.placement.filling = self._admit(request)
        except Exception as e:  # noqa: BLE001 - growing the cache (out of memory), scoring a cached prefix: this request ends
            self.placement.drop_filling()  # (a cached prefix may have been shared into its row)
            release_proposer(request)
            return [(request.id, TokenEvent([], "error", GenerationStats(prompt_tokens=len(request.prompt_ids)), e))]
        return []

    def fill(self) -> Events:
        """Admit waiting requests into free rows and prefill their prompts in passes of their own,
        one row at a time, as far as the step's prefill room goes (the scheduler's: while rows
        decode, as many prompt tokens as stall them little, less what rode in the decode pass;
        while none decodes, whole prompts). A prompt's passes draft nothing, exactly like plain
        decoding."""
        events: Events = []
        place = self.placement
        while (room := self.scheduler.prefill_room(len(place.rows))) != 0:
            if place.filling is None:
                if not self.scheduler.admits(len(place.rows)):
                    break
                events += self._take_waiting()
                continue
            row = place.filling
            size = min(len(row.tokens) - row.length, room or 1 << 62, self.invariant_rows or 1 << 62)
            events += self.prefill_chunk(row, size)
            self.scheduler.spend(size)  # (a failed pass's tokens too: the step paid for them)
        return events

    def _next_waiting(self) -> Request:
        """Take the waiting request to admit now (engine/scheduler.py: shortest remaining prefill
        first, none passed over forever); a prompt's last token is always fed, never cached."""
        prefix = self.placement.prefix
        return self.scheduler.next_admitted(lambda r: 0 if prefix is None else
                                            prefix.hit(r.prompt_ids, len(r.prompt_ids) - 1, r.cache_scope))

    def _admit(self, request: Request) -> Row:
        """A row for `request` in cache row n, holding the K/V of the longest prefix of its prompt
        that the prefix cache has (its last token is always fed: its logits give the first token)."""
        row = self._start_row(request)
        row.tokens = list(request.prompt_ids)
        place = self.placement
        place.reserve(len(place.rows) + 1, len(row.tokens) + row.budget + place.pad)
        features = place.fetch(row)
        if features is not None:
            row.features = [features]
            row.length = row.stats.cached_tokens = features.shape[0]
            self._score(row, 0, features)  # their features, cached too: only the LM head runs
        return row

    def prefill_chunk(self, row: Row, size: int) -> Events:
        """Feed the next `size` tokens of the filling row's prompt; after the last, it decodes from
        the next step on (it joins the running rows, whose cache row it already sits in)."""
        index, end, device = len(self.placement.rows), row.length + size, self.model.device
        t0 = time.perf_counter()
        try:
            out = self.model(torch.tensor([row.tokens[row.length:end]], device=device),
                             torch.arange(row.length, end, device=device)[None],
                             self.placement.cache.rows(index, index + 1), last_n=0)
        except Exception as e:  # noqa: BLE001 - only this row ran: only this request ends
            return self._fill_failed(row, e)
        return self.prefilled(row, size, out.features[0], time.perf_counter() - t0)

    def prefilled(self, row: Row, size: int, fed: torch.Tensor, seconds: float) -> Events:
        """The filling row's next `size` prompt tokens went through the model (their K/V are in its
        cache row; `fed`: their features [size, F]), in a pass of their own or riding along, adding `seconds` to
        the step. After the prompt's last token, the row decodes from the next step on (it joins
        the running rows, whose cache row it already sits in); its first token is sampled here from
        that token's logits alone, as a one-pass prefill scores it."""
        n, end = len(row.tokens), row.length + size
        t0 = time.perf_counter()
        try:
            self._score(row, row.length, fed)
        except Exception as e:  # noqa: BLE001 - only this row's: only this request ends
            return self._fill_failed(row, e)
        seconds += time.perf_counter() - t0  # the head over a scored chunk: its cost too (the next chunk's size)
        self.scheduler.prefilled(size, seconds)
        row.length = end
        row.features.append(fed)
        if end < n:
            row.stats.verify_s += seconds
            return []
        if row.budget == 0:
            return self._scored_only(row, seconds)
        try:
            logits = self.model.logits(fed[-1:])[None]  # [1, 1, V]
            verdict = verify([NO_DRAFT], logits, [row.request.params], [row.generator], [grammar_masks(row, 0)])
        except Exception as e:  # noqa: BLE001 - only this row's: only this request ends
            return self._fill_failed(row, e)
        place = self.placement
        place.filling = None
        place.rows.append(row)
        features = torch.cat(row.features)  # [n, F]: the whole prompt's, as a one-pass prefill gives them
        row.features = [features] if place.prefix is not None else []
        place.offer(row, len(place.rows) - 1, features)  # sessions that share this prompt need not wait for its end
        row.tokens += verdict.tokens[0]
        step = Committed(verdict.tokens[0], 0, 0, features, TopTokens(lambda: logits, [1]).row(0))
        events = self.emit([row], [step], seconds, [[TokenOrigin("target", 0)]],
                           [step_logprobs(row, logits[0], [], verdict.tokens[0])])
        events[0][1].prompt_logprobs = row.scored  # the prompt's scores go in its first event
        return events

    def _score(self, row: Row, start: int, fed: torch.Tensor) -> None:
        """For a request that scores its prompt, the log-probabilities of the prompt tokens that
        positions start.. predict (`fed` [m, F]: their features, as a forward over the whole
        prompt gives them); the last position's logits are the first new token's, not a prompt token's.
        In slices within the kernel's batch-invariant rows, so each is what a one-pass prefill gives."""
        top, prompt = row.request.prompt_logprobs, row.request.prompt_ids
        if top is None:
            return
        stop = min(start + fed.shape[0], len(prompt) - 1)
        rows = self.invariant_rows or SCORE_ROWS
        for at in range(start, stop, rows):
            end = min(at + rows, stop)
            logits = self.model.logits(fed[at - start:end - start])  # [end - at, V]
            row.scored += token_logprobs(logits, prompt[at + 1:end + 1], top)

    def _scored_only(self, row: Row, seconds: float) -> Events:
        """A prompt only prefilled (max_new_tokens 0) ends with its last pass, no token sampled, its
        scores in its one event; its K/V go to the prefix cache as an ended row's, and its cache row
        (past the running ones) gives its blocks back."""
        place = self.placement
        stats = row.stats
        stats.target_passes += 1
        stats.verify_s += seconds
        stats.total_s = time.perf_counter() - row.start
        place.leave(row, len(place.rows))
        place.drop_filling()
        release_proposer(row.request)
        return [(row.request.id, TokenEvent([], "length", stats.snapshot(), prompt_logprobs=row.scored))]

    def _fill_failed(self, row: Row, error: Exception) -> Events:
        """The filling row's prompt pass raised: only its request ends, its blocks and its proposer's
        state given back."""
        self.placement.drop_filling()
        release_proposer(row.request)
        row.stats.total_s = time.perf_counter() - row.start
        return [(row.request.id, TokenEvent([], "error", row.stats.snapshot(), error))]
