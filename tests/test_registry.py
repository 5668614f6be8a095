"""The proposer registry: each proposer's options dataclass is the one home of its settings, and
the command line, the benchmark's method list and SpecConfig take their defaults from it."""
from __future__ import annotations

import re

import pytest

from quickdraft.bench.specbench import parse_methods
from quickdraft.cli import build_parser
from quickdraft.cli.common import spec_from_args
from quickdraft.proposers import DEFAULT_K, DEFAULT_METHOD, PROPOSERS, SpecConfig, SpecConfigError
from quickdraft.proposers.ngram import NgramOptions
from quickdraft.proposers.registry import option_fields

COMMANDS = [["generate", "-p", "x"], ["serve"], ["bench", "specbench"], ["bench", "serve"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_has_the_same_k_default(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.k == DEFAULT_K == SpecConfig().k


SPEC_COMMANDS = [["generate", "-p", "x"], ["serve"], ["bench", "serve"], ["bench", "soak"]]


@pytest.mark.parametrize("argv", SPEC_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_front_door_has_the_same_default_proposer(argv: list[str], tmp_path) -> None:
    """The CLI's --spec default is SpecConfig()'s, which the Python API runs when given no spec."""
    args = build_parser().parse_args(argv)
    assert args.spec == DEFAULT_METHOD == SpecConfig().method != "none"
    assert SpecConfig().enabled and not SpecConfig(method="none").enabled


def test_the_python_api_speculates_by_default(tmp_path) -> None:
    import quickdraft
    from quickdraft.spec.sampling import SamplingParams
    from tiny_tokenizer import tiny_llm_dir
    llm = quickdraft.load(tiny_llm_dir(tmp_path / "model"))
    assert llm.spec == SpecConfig()
    prompt = "abc abc abc abc abc abc"  # repeats: prompt lookup drafts
    out = llm.generate(prompt, params=SamplingParams(max_new_tokens=12, ignore_eos=True))
    plain = llm.generate(prompt, params=SamplingParams(max_new_tokens=12, ignore_eos=True),
                         spec=SpecConfig(method="none"))
    assert out.stats.drafted_tokens > 0 and plain.stats.drafted_tokens == 0
    assert out.token_ids == plain.token_ids


def test_option_flags_come_from_the_registry_and_keep_their_defaults() -> None:
    assert set(option_fields()) >= {"ngram_max", "ngram_min"}
    args = build_parser().parse_args(["generate", "-p", "x"])
    assert spec_from_args(args).proposer_options() == NgramOptions()  # unset flags: the dataclass's defaults
    args = build_parser().parse_args(["generate", "-p", "x", "--ngram-min", "2", "--spec", "hybrid"])
    assert spec_from_args(args).proposer_options() == NgramOptions(ngram_min=2)
    methods = parse_methods("ngram,hybrid:/heads/h", 4, {"ngram_max": 3})
    assert [m.spec.proposer_options().ngram_max for m in methods[1:]] == [3, 3]


def test_options_are_validated_by_their_dataclass() -> None:
    with pytest.raises(SpecConfigError, match="ngram_min <= ngram_max"):
        SpecConfig("ngram", options={"ngram_min": 5, "ngram_max": 3})
    with pytest.raises(SpecConfigError, match="ngram_branches must be in 1..64, found 0"):  # registry.option's range
        SpecConfig("ngram-tree", options={"ngram_branches": 0})
    with pytest.raises(SpecConfigError, match="unknown proposer option.*ngram_max"):
        SpecConfig("ngram", options={"ngram_size": 3})
    # an option of another proposer is kept for a method switch (the server's per-request method)
    assert SpecConfig("draft", options={"ngram_min": 2}).options == {"ngram_min": 2}


@pytest.mark.parametrize("method, options, says", [
    ("ngram", {"ngram_max": 2.5}, "ngram_max must be an integer in 1..16, found 2.5"),
    ("ngram", {"ngram_max": float("nan")}, "ngram_max must be an integer in 1..16, found nan"),
    ("ngram", {"ngram_max": True}, "ngram_max must be an integer in 1..16, found True"),
    ("ngram", {"ngram_max": "3"}, "ngram_max must be an integer in 1..16, found '3'"),
    ("ngram-tree", {"ngram_branches": 2.5}, "ngram_branches must be an integer"),
    ("recycle", {"recycle_top": 2.5}, "recycle_top must be an integer"),
    ("draft", {"draft_vocab": 2.5}, "draft_vocab must be an integer"),
    ("suffix", {"suffix_tokens": 2.5}, "suffix_tokens must be an integer"),
])
def test_options_of_another_kind_are_refused_by_name(method: str, options: dict, says: str) -> None:
    with pytest.raises(SpecConfigError, match=f"proposer '{method}': " + re.escape(says)):
        SpecConfig(method, options=options)


@pytest.mark.parametrize("kw, says", [
    ({"method": ["ngram"]}, "method: expected a proposer's name, found list"),
    ({"options": None}, "options: expected a mapping of option names to values, found None"),
    ({"options": 5}, "options: expected a mapping"), ({"options": ["ngram_max"]}, "options: expected a mapping"),
    ({"options": {1: 2}}, "options: expected a mapping"),
    ({"draft_model": [1]}, "draft_model: expected a path (or a packaged name), found list"),
    ({"head": 5}, "head: expected a path"), ({"datastore": 5}, "datastore: expected a path"),
    ({"adaptive": "no"}, "adaptive: expected true or false, found 'no'"),
])
def test_spec_config_fields_of_another_kind_are_refused_by_name(kw: dict, says: str) -> None:
    with pytest.raises(SpecConfigError, match=re.escape(says)):
        SpecConfig(**kw)


def test_every_proposer_says_what_it_is() -> None:
    for name, entry in PROPOSERS.items():
        assert entry.name == name and entry.about
        assert entry.loads in (None, "draft_model", "head", "datastore")
