"""`quickdraft generate --threads N` runs on N torch threads, as serve and bench do, and says so in --json."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from quickdraft.cli import main
from tiny_tokenizer import tiny_llm_dir


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_generate_runs_on_the_threads_asked(tmp_path: Path, capsys: pytest.CaptureFixture, restore_threads) -> None:
    model = tiny_llm_dir(tmp_path / "model")
    base = ["generate", "--model", str(model), "--prompt", "hello", "-n", "3", "--json"]
    for n in (2, 1):
        assert main([*base, "--threads", str(n)]) == 0
        assert json.loads(capsys.readouterr().out)["runtime"]["threads"] == n == torch.get_num_threads()
    for n in (0, 4 * (os.cpu_count() or 1) + 1):
        assert main([*base, "--threads", str(n)]) == 1
        assert f"quickdraft: error: --threads must be in 1..{4 * (os.cpu_count() or 1)} " in capsys.readouterr().err
