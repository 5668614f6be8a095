"""Loading a Hugging Face model directory: config.json + model.safetensors (or a sharded index);
gpt-oss's MXFP4 experts as stored (weights/mxfp4.py).

Hands on every tensor of the files but the harmless ones names.IGNORED_TENSORS lists; the model
refuses any it does not take.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from quickdraft.errors import ModelLoadError
from quickdraft.kernels.quantized import QuantizedWeight
from quickdraft.model.config import ModelConfig, check_end_tokens
from quickdraft.weights.mxfp4 import unstack_blocks
from quickdraft.weights.names import ignored, unstack_experts

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
    config = ModelConfig.from_hf(raw)
    ends = generation_eos_ids(path)
    check_end_tokens(ends, config.vocab_size, str(path / "generation_config.json"))
    extra = tuple(i for i in ends if i not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + extra) if extra else config


def generation_eos_ids(path: Path) -> tuple[object, ...]:
    """The tokens generation_config.json ends on, which transformers' generate ends on too and
    config.json may list only one of (gpt-oss: <|return|> and <|call|> beside <|endoftext|>); as
    written (read_config checks them: config.check_end_tokens)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{file} is not a JSON object: {e}") from None
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def read_checkpoint(path: Path, as_stored: bool = True
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """config.json and the tensors (stacked experts as each expert's; MXFP4 ones as stored, or their
    float values where not `as_stored`), a tied LM head settled as transformers settles it."""
    config = read_config(path)
    tensors = unstack_blocks(read_tensors(path), config.family, as_stored)
    return settle_tied_head(config, unstack_experts(tensors, config.family))


def settle_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor | QuantizedWeight]
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """A config that ties the LM head to the embeddings over files that also hold `lm_head.weight`:
    a copy of the embeddings is dropped; a different head is the model's head, untied, as
    transformers 5 loads it (it warns and keeps both)."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return config, tensors
    if head.shape == embed.shape and torch.equal(head, embed):
        return config, {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return dataclasses.replace(config, tie_word_embeddings=False), tensors


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under its Hugging Face name, but names.IGNORED_TENSORS."""
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
    return {name: t for name, t in tensors.items() if not ignored(name)}
