"""The contract types (quickdraft/spec/draft_contract.py) load without the model or the kernels, and the
engine and verifier take them from there."""
import subprocess
import sys

import pytest

from quickdraft.proposers import base
from quickdraft.spec import draft_contract


def _modules_after(statement: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys; {statement}; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", ["quickdraft.spec.draft_contract", "quickdraft.spec.goodput"])
def test_contract_imports_neither_model_nor_kernels(module: str):
    loaded = _modules_after(f"import {module}")
    assert module in loaded
    heavy = sorted(m for m in loaded if m.startswith(("quickdraft.model", "quickdraft.kernels", "quickdraft.proposers")))
    assert heavy == [], heavy


def test_the_check_sees_what_base_imports():
    # negative control: the proposers' base module does load the model and the kernels
    loaded = _modules_after("import quickdraft.proposers.base")
    assert "quickdraft.model.llama" in loaded and "quickdraft.kernels" in loaded


def test_base_reexports_the_contract_types():
    for name in ("MAX_K", "NO_DRAFT", "Committed", "Draft", "PassCost", "Proposer", "ProposerGroup"):
        assert getattr(base, name) is getattr(draft_contract, name)
