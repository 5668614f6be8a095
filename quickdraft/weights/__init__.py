"""Turning files on disk (Hugging Face directories, GGUF files) into a model and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer, build_transformer
from quickdraft.tokenizer import Tokenizer, gguf_tokenizer, load_hf_tokenizer
from quickdraft.weights import gguf_file, hf_dir
from quickdraft.weights.resolve import DEFAULT_MODEL, ModelSource, resolve_model

__all__ = ["DEFAULT_MODEL", "LoadedModel", "load_model", "resolve_model"]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: ModelSource

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def load_model(name_or_path: str | Path | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = False) -> LoadedModel:
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        ckpt = gguf_file.read_gguf(source.path, progress=progress)
        config, tensors, freq_factors = ckpt.config, ckpt.tensors, ckpt.rope_freq_factors
        tokenizer = gguf_tokenizer(ckpt.metadata, config.eos_token_ids)
    else:
        config = hf_dir.read_config(source.path)
        tensors, freq_factors = hf_dir.read_tensors(source.path), None
        tokenizer = load_hf_tokenizer(source.path, config.eos_token_ids)
    model = build_transformer(config, tensors, device=device, dtype=dtype, rope_freq_factors=freq_factors)
    return LoadedModel(model, tokenizer, source)
