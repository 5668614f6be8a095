"""Speculative-decoding settings users get wrong, and the CLI's --spec / --compare.

Each error is checked for its type and for a message naming what was expected and what was found;
each broken draft model is a copy of one that works (checked first), changed in one way. The
CLI's --compare output is checked against the API's own plain and speculative runs.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer

import quickdraft
from quickdraft import SamplingParams, SpecConfig, SpecConfigError
from quickdraft.cli import main
from quickdraft.proposers import MAX_K
from tiny_tokenizer import tiny_llm_dir

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    good_draft = tiny_llm_dir(root / "draft", "qwen2-qkv-bias", seed=1, num_hidden_layers=1)
    # The target at init 0.05 half-repeats itself on PROMPT: n-gram drafts are made, some accepted.
    out = {"target": tiny_llm_dir(root / "target", initializer_range=0.05), "draft": good_draft,
           "vocab320": tiny_llm_dir(root / "vocab320", seed=1, num_hidden_layers=1, vocab_size=320)}
    # Same model vocabulary size, one token string changed: ids 125 ('z') and 129 ('~') renamed.
    renamed = Path(shutil.copytree(good_draft, root / "renamed"))
    tok = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert (vocab["z"], vocab["~"]) == (125, 129)
    vocab["\u1e91"] = vocab.pop("z")
    vocab["\u223c"] = vocab.pop("~")
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    out["renamed"] = renamed
    # Same model vocabulary size, and a tokenizer with one token more (id 272) than the target's.
    extra = Path(shutil.copytree(good_draft, root / "extra"))
    backend = Tokenizer.from_file(str(extra / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|extra|>", special=True, normalized=False)])
    backend.save(str(extra / "tokenizer.json"))
    out["extra"] = extra
    return out


@pytest.fixture(scope="module")
def llm(dirs: dict[str, Path]) -> quickdraft.LLM:
    return quickdraft.load(dirs["target"])


# -- SpecConfig -----------------------------------------------------------------------------------------------

def test_unknown_proposer_lists_the_valid_names() -> None:
    with pytest.raises(SpecConfigError) as e:
        SpecConfig(method="bogus")
    msg = str(e.value)
    assert "'bogus'" in msg and "ngram" in msg and "draft" in msg


@pytest.mark.parametrize("k", [-1, 1000, MAX_K + 1, 2.5, True, "4"])
def test_bad_k(k: object) -> None:
    with pytest.raises(SpecConfigError) as e:
        SpecConfig(method="ngram", k=k)
    assert "k must be" in str(e.value) and repr(k) in str(e.value)


@pytest.mark.parametrize("k", [0, 1, MAX_K])
def test_k_edges_are_accepted(k: int) -> None:
    assert SpecConfig(method="ngram", k=k).k == k


def test_draft_without_a_draft_model(dirs: dict[str, Path]) -> None:
    spec = SpecConfig(method="draft", k=4)  # valid: it means the target's packaged draft (test_packaged_draft.py)
    assert spec.draft_model is None
    with pytest.raises(SpecConfigError, match="needs a draft model, and none ships for a model loaded from .*"
                                              "--draft-model"):
        quickdraft.load(dirs["target"], spec=spec)  # a target that has none


def test_spec_config_error_is_a_quickdraft_error() -> None:
    assert issubclass(SpecConfigError, quickdraft.QuickdraftError)


# -- draft model compatibility ---------------------------------------------------------------------------------

def test_compatible_draft_loads_and_is_exact(llm: quickdraft.LLM, dirs: dict[str, Path]) -> None:
    # The fixture the broken drafts start from works: a Qwen2 draft for a Llama target, same tokenizer.
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    spec = SpecConfig(method="draft", k=3, draft_model=str(dirs["draft"]))
    out = llm.generate(PROMPT, params=params, spec=spec)
    assert out.token_ids == llm.generate(PROMPT, params=params).token_ids
    assert out.stats.drafted_tokens > 0
    assert llm.draft_model(str(dirs["draft"])) is llm.draft_model(str(dirs["draft"]))  # loaded once


def test_draft_with_another_vocabulary_size(llm: quickdraft.LLM, dirs: dict[str, Path]) -> None:
    with pytest.raises(SpecConfigError) as e:
        llm.draft_model(str(dirs["vocab320"]))
    assert "320" in str(e.value) and "300" in str(e.value)


def test_draft_with_a_different_token_names_the_first_mismatch(llm: quickdraft.LLM,
                                                                dirs: dict[str, Path]) -> None:
    with pytest.raises(SpecConfigError) as e:
        llm.draft_model(str(dirs["renamed"]))
    msg = str(e.value)
    assert "125" in msg and "'\u1e91'" in msg and "'z'" in msg
    assert "129" not in msg  # the first mismatch, not the second


def test_draft_tokenizer_with_an_extra_token(llm: quickdraft.LLM, dirs: dict[str, Path]) -> None:
    # Both models have 300 rows, but token 272 is '<|extra|>' for the draft and nothing for the
    # target's tokenizer: the two do not share a tokenizer.
    with pytest.raises(SpecConfigError) as e:
        llm.draft_model(str(dirs["extra"]))
    assert "272" in str(e.value)


def test_incompatible_draft_fails_at_load(dirs: dict[str, Path]) -> None:
    # quickdraft.load(spec=...) checks the draft then, not at the first request.
    with pytest.raises(SpecConfigError, match="125"):
        quickdraft.load(dirs["target"], spec=SpecConfig(method="draft", draft_model=str(dirs["renamed"])))


# -- command line -------------------------------------------------------------------------------------------

def cli(*args: str) -> list[str]:
    return ["generate", "--prompt", PROMPT, "-n", "12", "--ignore-eos", *args]


def test_cli_unknown_spec_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(cli("--spec", "bogus"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "ngram" in err and "draft" in err


@pytest.mark.parametrize("args, words", [
    (("--spec", "ngram", "-k", "1000"), ["k must be", "1000"]),
    (("--spec", "ngram", "-k", "-1"), ["k must be", "-1"]),
    (("--spec", "draft"), ["draft model"]),
    (("--compare", "--spec", "none"), ["--compare", "--spec"]),
    (("--compare", "--spec", "ngram", "-k", "0"), ["--compare", "--spec"]),
])
def test_cli_spec_errors_are_one_line(args: tuple[str, ...], words: list[str], dirs: dict[str, Path],
                                      capsys: pytest.CaptureFixture) -> None:
    assert main(cli("--model", str(dirs["target"]), *args)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("quickdraft: error: ") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err
    for word in words:
        assert word in captured.err


def test_cli_incompatible_draft_is_one_line(dirs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(cli("--model", str(dirs["target"]), "--spec", "draft", "--draft-model", str(dirs["renamed"]))) == 1
    err = capsys.readouterr().err
    assert err.startswith("quickdraft: error: ") and "125" in err and "Traceback" not in err


STATS_KEYS = {"prompt_tokens", "new_tokens", "target_passes", "drafted_tokens", "accepted_tokens",
              "acceptance_rate", "tokens_per_pass", "acceptance_by_position", "propose_s", "verify_s", "other_s"}


@pytest.mark.parametrize("spec_args", [("--spec", "ngram", "-k", "3"), ("--spec", "draft", "-k", "2")])
def test_cli_compare_json(spec_args: tuple[str, ...], llm: quickdraft.LLM, dirs: dict[str, Path],
                          capsys: pytest.CaptureFixture) -> None:
    if spec_args[1] == "draft":  # the target drafting for itself: every draft accepted, so drafting pays
        spec_args += ("--draft-model", str(dirs["target"]))  # (the model's engine has measured its steps by then)
    assert main(cli("--model", str(dirs["target"]), "--compare", "--json", *spec_args)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert {"plain", "speculative", "speedup", "identical", "stats", "token_ids"} <= set(obj)
    plain, spec = obj["plain"], obj["speculative"]
    ref = llm.generate(PROMPT, params=SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    assert plain["token_ids"] == spec["token_ids"] == obj["token_ids"] == ref
    assert obj["identical"] is True
    assert STATS_KEYS <= set(obj["stats"]) and STATS_KEYS <= set(plain["stats"]) and STATS_KEYS <= set(spec["stats"])
    assert obj["stats"] == spec["stats"]
    assert plain["stats"]["drafted_tokens"] == 0 and plain["stats"]["target_passes"] == 12
    # how much it drafts is the policy's call from measured step times (none, on a loaded machine,
    # can be right): the figures must agree with one another
    assert 0 <= spec["stats"]["accepted_tokens"] <= spec["stats"]["drafted_tokens"]
    assert spec["stats"]["target_passes"] + spec["stats"]["accepted_tokens"] >= spec["stats"]["new_tokens"]
    assert spec["stats"]["new_tokens"] == plain["stats"]["new_tokens"] == 12
    medians = obj["median_tokens_per_s"]  # of the interleaved rounds; the last round's runs are plain and speculative
    assert obj["speedup"] == pytest.approx(medians["speculative"] / medians["plain"]) and obj["rounds"] == 3


def test_cli_spec_json_has_stats(dirs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(cli("--model", str(dirs["target"]), "--json", "--spec", "ngram", "-k", "2")) == 0
    obj = json.loads(capsys.readouterr().out)
    assert STATS_KEYS <= set(obj["stats"]) and "plain" not in obj and "identical" not in obj
    s = obj["stats"]
    assert s["new_tokens"] == 12 == len(obj["token_ids"])
    assert len(s["acceptance_by_position"]) <= 2


def test_draft_on_another_device_is_refused(llm: quickdraft.LLM) -> None:
    """The draft must run beside the target; a model on another device is named in the error."""
    from types import SimpleNamespace

    from quickdraft.proposers.draft_model import check_compatible

    elsewhere = SimpleNamespace(model=SimpleNamespace(device=torch.device("meta"), config=llm.model.config),
                                tokenizer=llm.tokenizer)
    with pytest.raises(SpecConfigError, match="meta.*cpu.*same device"):
        check_compatible(llm, elsewhere)
