"""Optional dependencies: a command that needs a package of one of quickdraft's extras (`bench`,
`train`; pyproject.toml pins them) checks for it before its slow work and fails with one line
naming the extra to install. Knows no command and no pin.
"""
from __future__ import annotations

import importlib.util

from quickdraft.errors import QuickdraftError


def require(extra: str, *modules: str, needed_for: str) -> None:
    """Raise QuickdraftError naming `extra` unless every module can be imported."""
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise QuickdraftError(f"{needed_for} needs {', '.join(missing)}, from quickdraft's `{extra}` extra: "
                              f"pip install 'quickdraft[{extra}]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is no package; a module blocked in sys.modules
        return False
