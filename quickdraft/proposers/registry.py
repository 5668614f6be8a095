"""The registry of proposers: each registers its factory together with its own frozen options
dataclass (defaults included), so command-line flags, the benchmark's method list and SpecConfig
read each setting and its default from one home. Knows no proposer.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Literal

FileKind = Literal["draft_model", "head", "datastore"]  # the SpecConfig field naming a file a proposer drafts with


def option(default: Any, help: str, lo: float | None = None, hi: float | None = None) -> Any:
    """A proposer option's field: its default, one line of help, and for a number the range it
    must lie in (checked by `check_ranges`, shown by --help and the server's published schema)."""
    return dataclasses.field(default=default, metadata={"help": help, "range": (lo, hi)})


def check_ranges(options: Any) -> None:
    """Raise ValueError naming the first option of an options dataclass of another kind than its
    default (an integer's a whole number, never a bool) or outside its range."""
    for f in dataclasses.fields(options):
        lo, hi = f.metadata.get("range", (None, None))
        value = getattr(options, f.name)
        kind = numbers.Integral if isinstance(f.default, int) else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind) or value != value:  # NaN != NaN
            raise ValueError(f"{f.name} must be {'an integer' if kind is numbers.Integral else 'a number'} in "
                             f"{lo}..{hi}, found {value!r}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"{f.name} must be in {lo}..{hi}, found {value!r}")


@dataclass(frozen=True)
class NoOptions:
    """The options of a proposer without settings of its own."""


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Any], Any]   # ProposerContext -> Proposer
    options: type = NoOptions       # a frozen dataclass: the proposer's settings, each with its default
                                    # and a "help" in its field metadata
    loads: FileKind | None = None   # the kind of file it drafts with, if any
    needs_file: bool = False        # it cannot run without that file
    about: str = ""                 # one line for --help
    picks: Callable[[Any, Any], str] | None = None  # for a name that runs another proposer (auto):
                                    # (Target, SpecConfig) -> the registered name it runs


PROPOSERS: dict[str, Registration] = {}


def register(name: str, options: type = NoOptions, loads: FileKind | None = None, needs_file: bool = False,
             about: str = "", picks: Callable[[Any, Any], str] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a factory (ProposerContext -> Proposer) to make it selectable by `name`."""
    def wrap(factory: Callable) -> Callable:
        PROPOSERS[name] = Registration(name, factory, options, loads, needs_file, about, picks)
        return factory
    return wrap


def runs(name: str, target: Any, config: Any) -> str:
    """The registered name of the proposer that `name` runs for this target and SpecConfig: itself,
    or the one it picks (auto)."""
    picks = PROPOSERS[name].picks
    return name if picks is None else runs(picks(target, config), target, config)


def registration(name: str) -> Registration:
    return PROPOSERS[name]


def option_fields() -> dict[str, dataclasses.Field]:
    """Every proposer option by name. Proposers sharing an option (the hybrid's n-gram sizes) share
    its dataclass field, so one name has one default; a clash is a programming error."""
    fields: dict[str, dataclasses.Field] = {}
    for entry in PROPOSERS.values():
        for f in dataclasses.fields(entry.options):
            assert f.name not in fields or fields[f.name].default == f.default, \
                f"proposer option {f.name!r} has two defaults: {fields[f.name].default!r}, {f.default!r}"
            assert isinstance(f.default, bool) or not isinstance(f.default, (int, float)) or \
                None not in f.metadata.get("range", (None, None)), \
                f"proposer option {f.name!r} is a number without a range (registry.option(..., lo, hi))"
            fields.setdefault(f.name, f)
    return fields


def option_names() -> list[str]:
    return sorted(option_fields())
