"""The proposer wing's shared parts: SpecConfig, the Target and ProposerContext factories get,
the group of the proposers that draft alone (EACH), a group's call with each member's failure its
own (together), the target's top tokens (TopTokens). The contract types (Draft, Committed,
Proposer, ProposerGroup) live in quickdraft/spec/draft_contract.py, re-exported here.

A proposer guesses the next tokens of one request; the engine verifies them with the target.
It must not know the engine's loop: it is told what was committed and nothing else.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence, TypeVar

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.kernels import topk_indices
from quickdraft.kv.prefix_cache import PrefixCache
from quickdraft.model.llama import Transformer
from quickdraft.proposers.registry import PROPOSERS, option_names, register, registration
from quickdraft.spec.draft_contract import MAX_K, NO_DRAFT, Committed, Draft, PassCost, Proposer, ProposerGroup, attempt
from quickdraft.spec.sampling import SamplingParams

T = TypeVar("T")

DEFAULT_K = 8  # draft tokens (tree nodes) per step at most, unless asked otherwise
# The proposer when none is named, in Python (SpecConfig()), the CLI and the server alike: prompt
# lookup, the fastest measured on a CPU (docs/notes/smollm2.md, Spec-Bench and bench serve: the shipped
# head does not pay for its drafting yet, alone or in the hybrid); "none" is plain decoding.
DEFAULT_METHOD = "ngram"


class SpecConfigError(QuickdraftError, ValueError):
    """Invalid speculative-decoding settings (unknown proposer, bad k, unusable draft model)."""


class TopTokens:
    """The target's likeliest next tokens at the positions one pass verified, for each of its rows:
    made on the first ask (`Committed.top`) for every row at once, so a step costs one top-k and one
    host sync when some proposer asks (and the LM head over the positions verification did not
    score: a proposer that asks every step marks its drafts `scored_whole`), nothing when none does."""

    def __init__(self, logits: Callable[[], torch.Tensor], scored: Sequence[int]) -> None:
        # logits() -> [B, W, V] (the engine scores the positions verification left out only if asked);
        self.logits, self.scored = logits, scored  # scored[b]: row b's positions (1 + verified nodes)
        self.ids: dict[int, list[list[list[int]]]] = {}  # n -> [B][W][n]

    def row(self, b: int) -> Callable[[int], list[list[int]]]:
        return lambda n: self._top(n)[b][:self.scored[b]]

    def _top(self, n: int) -> list[list[list[int]]]:
        if n not in self.ids:
            self.ids[n] = topk_indices(self.logits(), n).tolist()  # the one host sync for it this step
        return self.ids[n]


class Each:
    """The group of the proposers that draft alone (EACH): its calls tell or ask each member in
    turn, each member's failure its own."""

    def commit(self, members: Sequence[Proposer], steps: Sequence[Committed]) -> list[Exception | None]:
        return [attempt(partial(member.commit, step)) for member, step in zip(members, steps, strict=True)]

    def propose(self, members: Sequence[Proposer], budgets: Sequence[int]) -> list[Draft | Exception]:
        return [attempt(partial(member.propose, k)) for member, k in zip(members, budgets, strict=True)]

    def release(self, members: Sequence[Proposer]) -> None:
        """Nothing is held for them beyond the members themselves, but by the groups of the
        proposers a member drafts through (its `parts`, where it has them: the hybrid's), which
        are released with it."""
        failures = [attempt(partial((part.group or EACH).release, [part]))
                    for member in members for part in getattr(member, "parts", ())]
        if error := next((f for f in failures if isinstance(f, Exception)), None):
            raise error  # after every part had its turn


EACH = Each()


@dataclass(frozen=True)
class Outcome:
    value: Any = None               # what the group's call gave this member
    error: Exception | None = None  # the call failed for this member: its request ends, no other
    seconds: float = 0.0            # this member's share of the time spent


def together(call: Callable[[Sequence[Any], Sequence[Any]], list[Any]], members: Sequence[Any],
             args: Sequence[Any]) -> list[Outcome]:
    """call(members, args), a ProposerGroup's commit or propose, its time shared by the members;
    if it raises, each member alone (a call of one), so the failure lands on its own member."""
    t0 = time.perf_counter()
    try:
        values = call(members, args)
    except Exception as e:  # noqa: BLE001 - a member's own, or whose shows below, each member alone
        if len(members) == 1:
            return [Outcome(None, e, time.perf_counter() - t0)]
        return [outcome for member, arg in zip(members, args) for outcome in together(call, [member], [arg])]
    share = (time.perf_counter() - t0) / len(members)
    return [Outcome(None, value, share) if isinstance(value, Exception) else Outcome(value, None, share)
            for value in values]


@dataclass(frozen=True)
class SpecConfig:
    method: str = DEFAULT_METHOD  # a registry name; "none" = plain decoding
    k: int = DEFAULT_K            # draft tokens (tree nodes) per step at most
    draft_model: str | None = None  # None: the target's packaged draft, if it has one (LLM.draft_name)
    head: str | None = None       # a trained draft head's directory (None = the head that ships for
                                  # the target, if one does)
    adaptive: bool = True         # verify only the part of a draft expected to pay for itself
    options: Mapping[str, Any] = field(default_factory=dict)  # proposers' own settings by name (as
                                  # their options dataclasses spell them); unset ones keep defaults
    datastore: str | None = None  # a datastore file of the target's answers (proposers/datastore.py;
                                  # None = the one that ships for the target, if one does)

    def __post_init__(self) -> None:
        self._check_kinds()
        if self.method not in PROPOSERS and self.method != "none":
            raise SpecConfigError(f"unknown proposer {self.method!r}; valid names: "
                                  f"{', '.join(['none', *sorted(PROPOSERS)])}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_K:
            raise SpecConfigError(f"k must be an integer in 0..{MAX_K}, found {self.k!r}")
        unknown = sorted(set(self.options) - set(option_names()))
        if unknown:
            raise SpecConfigError(f"unknown proposer option(s) {', '.join(unknown)}; valid names: "
                                  f"{', '.join(option_names())}")
        if self.method != "none":
            self.proposer_options()  # each options dataclass validates its own values

    def _check_kinds(self) -> None:
        """Each field of the kind it holds (the server's bodies are checked by their schema; the
        Python API's values here), so that a wrong one is refused by name, not deep in a proposer."""
        if not isinstance(self.method, str):
            raise SpecConfigError(f"method: expected a proposer's name, found {type(self.method).__name__}")
        if not isinstance(self.options, Mapping) or not all(isinstance(name, str) for name in self.options):
            raise SpecConfigError(f"options: expected a mapping of option names to values, found {self.options!r}")
        for name in ("draft_model", "head", "datastore"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise SpecConfigError(f"{name}: expected a path (or a packaged name), found {type(value).__name__}")
        if not isinstance(self.adaptive, bool):
            raise SpecConfigError(f"adaptive: expected true or false, found {self.adaptive!r}")

    def proposer_options(self) -> Any:
        """The method's own options dataclass: the settings it has from `options`, defaults for the rest."""
        kind = registration(self.method).options
        try:
            return kind(**{name: value for name, value in self.options.items() if name in kind.__dataclass_fields__})
        except (TypeError, ValueError) as e:
            raise SpecConfigError(f"proposer {self.method!r}: {e}") from None

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.k > 0

    @property
    def needs_draft_model(self) -> bool:
        """The proposer drafts with a draft model (which must load)."""
        return self.enabled and registration(self.method).loads == "draft_model"

    @property
    def needs_head(self) -> bool:
        """A draft head must load: the proposer cannot do without one, or one is named."""
        if not self.enabled:
            return False
        entry = registration(self.method)
        return entry.loads == "head" and (entry.needs_file or bool(self.head))

    @property
    def needs_datastore(self) -> bool:
        """The proposer drafts from a datastore (which must load)."""
        return self.enabled and registration(self.method).loads == "datastore"


class Target(Protocol):
    """What a proposer factory may draw on (quickdraft.api.LLM is one): the target model, and the
    files proposers draft with, each loaded once and checked against the target."""
    model: Transformer
    name: str | None  # the packaged name it was loaded by (None: a path)
    prefix: PrefixCache | None  # the target's prefix cache (None: off), whose budget sizes a draft's

    def draft_model(self, name_or_path: str | None = None) -> Any:
        """A draft model sharing the target's vocabulary (its `.model` and `.tokenizer`); None: the
        packaged one."""

    def draft_head(self, path: str | None = None) -> Any:
        """A DraftHead trained for the target; None: the one that ships for it."""

    def datastore(self, path: str | None = None) -> Any:
        """A Datastore of the target's answers (proposers/datastore.py); None: the one that ships for it."""

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """State that proposers share across the requests of this target (a draft model's batched
        cache, tables learned from earlier passes): `make()` on the key's first use, then the same
        object for as long as the target lives."""


@dataclass
class ProposerContext:
    """What a proposer factory may use to start on one request."""
    prompt_ids: list[int]
    params: SamplingParams
    config: SpecConfig
    target: Target
    scope: str = ""  # the request's prefix-cache scope (engine/rows.py Request.cache_scope): a drafter's cache too

    @property
    def options(self) -> Any:
        """The proposer's own options dataclass (proposers/registry.py)."""
        return self.config.proposer_options()


__all__ = ["DEFAULT_K", "EACH", "MAX_K", "NO_DRAFT", "PROPOSERS", "Committed", "Draft", "Each", "Outcome", "PassCost",
           "Proposer", "ProposerContext", "ProposerGroup", "SpecConfig", "SpecConfigError", "Target", "TopTokens",
           "register", "together"]
