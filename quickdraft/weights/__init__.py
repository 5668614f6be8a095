"""Turning files on disk (Hugging Face directories, GGUF files) into a model and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.errors import ModelLoadError
from quickdraft.model.build import build_transformer
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.weights import gguf_file, hf_dir
from quickdraft.weights.activations import CALIBRATION, activation_bits, choose_bits, with_activation_bits
from quickdraft.weights.quantize import quantize_tensors
from quickdraft.weights.resolve import DEFAULT_MODEL, ModelSource, resolve_model
from quickdraft.weights.tokenizers import gguf_tokenizer, load_hf_tokenizer

__all__ = ["DEFAULT_MODEL", "LoadedModel", "load_model", "load_tokenizer", "resolve_model"]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: ModelSource
    activations: str | None = None  # the precision asked for at load (None: the model's default)

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def load_model(name_or_path: str | Path | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = False,
               dequantize: bool = False, quantize: str | None = None,
               activations: str | None = None) -> LoadedModel:
    """`dtype` is that of activations and of unquantized tensors. A quantized GGUF (or gpt-oss's
    MXFP4 checkpoint) runs as stored on CPU unless `dequantize` (then, and on other devices, its
    matrices become `dtype`).
    `quantize` ('int8' or 'int4', CPU only) quantizes float matrices at load (weights/quantize.py).
    `activations` ('int16' or 'int8') is what the integer kernel rounds activations to for
    matrices kept quantized; None: the file's measured choice (weights/activations.py)."""
    if quantize is not None and (dequantize or torch.device(device).type != "cpu"):
        raise ModelLoadError("--quantize runs on CPU and cannot be combined with --dequantize")
    source = resolve_model(name_or_path)
    bits = activation_bits(source, activations)
    as_stored = not dequantize and torch.device(device).type == "cpu"
    if source.kind == "gguf":
        ckpt = gguf_file.read_gguf(source.path, progress=progress, quantized=as_stored)
        config, tensors, freq_factors = ckpt.config, ckpt.tensors, ckpt.rope_freq_factors
        tokenizer = gguf_tokenizer(ckpt.metadata, config.eos_token_ids)
    else:
        (config, tensors), freq_factors = hf_dir.read_checkpoint(source.path, as_stored), None
        tokenizer = load_hf_tokenizer(source.path, config.eos_token_ids)
    if quantize is not None:
        tensors = quantize_tensors(tensors, quantize, progress=progress)
    tensors = with_activation_bits(tensors, bits or 16)
    model = build_transformer(config, tensors, device=device, dtype=dtype, rope_freq_factors=freq_factors)
    if bits is None and model.quantized:  # a file not measured yet: once, now (weights/activations.py)
        choose_bits(model, tokenizer.encode(CALIBRATION), source)
    return LoadedModel(model, tokenizer, source, activations)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The model's tokenizer alone (a GGUF file's metadata or a directory's tokenizer files), no weights."""
    if source.kind == "gguf":
        return gguf_tokenizer(gguf_file.read_metadata(gguf_file.open_reader(source.path)))
    return load_hf_tokenizer(source.path)
