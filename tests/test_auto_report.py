"""`--spec auto` says which proposer it ran: in the stats line, in `--json`, and to Python
(LLM.proposer_name), the same one the proposer factory builds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import quickdraft
from quickdraft.cli import main
from quickdraft.proposers import SpecConfig, SpecConfigError
from quickdraft.proposers.head import save_head
from quickdraft.proposers.hybrid import HybridProposer
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.proposers.registry import runs
from quickdraft.spec.sampling import SamplingParams
from support.heads import random_head
from tiny_tokenizer import tiny_llm_dir

PROMPT = "abc abc abc abc"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[quickdraft.LLM, Path, Path]:
    root = tmp_path_factory.mktemp("auto")
    model_dir = tiny_llm_dir(root / "model")
    llm = quickdraft.load(str(model_dir))
    head_dir = save_head(random_head(llm.model, 4), llm.model, root / "head", "tiny")
    return llm, model_dir, head_dir


def test_the_name_reported_is_the_proposer_built(tiny) -> None:
    llm, _, head_dir = tiny
    ids, params = llm.prompt_ids(PROMPT), SamplingParams(max_new_tokens=4)
    for spec, kind, name in [(SpecConfig("auto"), NgramProposer, "ngram"),  # no head ships for a tiny model
                             (SpecConfig("auto", head=str(head_dir)), HybridProposer, "hybrid"),
                             (SpecConfig("ngram"), NgramProposer, "ngram")]:
        assert isinstance(llm.proposer(ids, params, spec), kind)
        assert llm.proposer_name(spec) == name
    assert llm.proposer_name(SpecConfig(method="none")) is None
    assert llm.proposer_name() == "ngram"  # the model's default


class _Target:
    def __init__(self, name: str | None, head: bool, datastore: bool = True) -> None:
        self.name, self.head, self.has_datastore = name, head, datastore

    def draft_head(self, path: str | None = None) -> object:
        if not self.head:
            raise SpecConfigError("no head")
        return object()

    def datastore(self, path: str | None = None) -> object:
        if not self.has_datastore:
            raise SpecConfigError("no datastore")
        return object()


@pytest.mark.parametrize("name, head, datastore, named, expected", [
    ("qwen2.5-coder-1.5b", False, True, None, "lookup-store"),  # measured (AUTO_MEASURED)
    ("smollm2-135m", True, True, None, "lookup-store"),         # measured, though a head ships for it
    ("smollm2-135m", True, False, None, "hybrid"),              # its datastore missing: the head it has
    ("qwen2.5-coder-1.5b", False, False, None, "ngram"),        # neither
    (None, False, True, None, "ngram"),                         # no measurement, no head
    ("qwen2.5-coder-1.5b", True, True, "/a/head", "hybrid"),    # a head named wins over the measurement
])
def test_what_auto_picks(name: str | None, head: bool, datastore: bool, named: str | None, expected: str) -> None:
    assert runs("auto", _Target(name, head, datastore), SpecConfig("auto", head=named)) == expected


def test_generate_says_what_auto_ran(tiny, capsys: pytest.CaptureFixture) -> None:
    _, model_dir, head_dir = tiny
    base = ["generate", "--model", str(model_dir), "--prompt", PROMPT, "-n", "6", "--ignore-eos"]
    assert main([*base, "--spec", "auto", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert (obj["proposer"], obj["spec"]["method"]) == ("ngram", "auto")
    assert main([*base, "--spec", "auto", "--head", str(head_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proposer"] == "hybrid"
    assert main([*base, "--spec", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proposer"] == "none"
    assert main([*base, "--spec", "auto"]) == 0
    assert "| proposer: ngram (auto) | finish: length]" in capsys.readouterr().err
    assert main(base) == 0  # the default names itself, without "(auto)"
    assert "| proposer: ngram | finish: length]" in capsys.readouterr().err
