"""Loading a Hugging Face model directory: config.json + model.safetensors (or a sharded index)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from quickdraft.errors import ModelLoadError
from quickdraft.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def read_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} should hold a JSON object, found {type(raw).__name__}")
    return ModelConfig.from_hf(raw)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under its Hugging Face name."""
    single, index = path / "model.safetensors", path / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(
            f"{path} has neither model.safetensors nor {INDEX_FILE}; expected safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"weight shard {file} named in {INDEX_FILE} is missing")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    return tensors
