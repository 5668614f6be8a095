"""A model's tokenizer from its files: the tokenizer.json beside Hugging Face weights, or the one a
GGUF file's metadata describes, rebuilt with transformers' converters and kept in the user's cache.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from quickdraft.errors import ModelLoadError
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.weights.packaged import default_cache_dir


def load_hf_tokenizer(path: Path, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json; expected a tokenizer beside the weights")
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ModelLoadError(f"could not load the tokenizer in {path}: {type(e).__name__}: {e}") from None
    return Tokenizer(hf, extra_eos_ids)


def gguf_tokenizer(metadata: dict[str, Any], extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
    """Rebuild the tokenizer a GGUF file describes, reusing transformers' GGUF converters; read back
    from the user's cache where this metadata was rebuilt before (_backend_key says why)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    fields = {name: metadata[f"tokenizer.{key}"]
              for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in metadata}
    arch = metadata["general.architecture"]
    tokens = fields["tokens"]

    def special(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    def wrapped(**backend: Any) -> Any:
        return PreTrainedTokenizerFast(
            **backend, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
            unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"))

    path = _backend_cache() / f"{_backend_key(arch, fields)}.json"
    hf = None
    if path.is_file():
        try:  # from the file: one parse (a backend object given is deep-copied: ~2 parses)
            hf = wrapped(tokenizer_file=str(path))
        except Exception:  # a damaged file (the tokenizers library's own error type): rebuilt below
            hf = None
    if hf is None:
        try:
            backend, _ = convert_gguf_tokenizer(arch, fields)
        except Exception as e:
            raise ModelLoadError(f"could not build the tokenizer from GGUF metadata: {type(e).__name__}: {e}") from None
        _write_backend(path, backend)
        hf = wrapped(tokenizer_object=backend)
    # GGUF says whether a BOS is prepended (Gemma's files: yes, as llama.cpp tokenizes them); the
    # rebuilt backend must not guess, and transformers' default (none) is not the file's word.
    hf.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    return Tokenizer(hf, extra_eos_ids)


def _backend_key(arch: str, fields: dict[str, Any]) -> str:
    """Rebuilding a GGUF's tokenizer took 8.5 s for Gemma 3's 262k tokens on 2 cores (the
    converter, then transformers deep-copying the backend it is handed); the rebuilt backend is
    kept in the user's cache under a hash of everything it is built from: the converter's
    versions, the architecture and the tokenizer metadata. So a file's second load reads it back
    and a vocabulary changed anywhere gets a key of its own (a file fingerprint of the first and
    last MiB would miss a change in the middle of a 262k vocabulary's ~5 MB of metadata)."""

    import tokenizers
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__}\0{tokenizers.__version__}\0{arch}".encode())
    for name in sorted(fields):
        value = fields[name]
        digest.update(f"\0{name}\0{type(value).__name__}\0{len(value) if isinstance(value, list) else ''}\0".encode())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            digest.update("\0".join(value).encode("utf-8", "surrogatepass"))  # the vocabulary, fast
        else:
            digest.update(json.dumps(value).encode())
    return digest.hexdigest()[:32]


def _backend_cache() -> Path:
    return default_cache_dir().parent / "tokenizers"


def _write_backend(path: Path, backend: Any) -> None:
    """Best-effort: a cache that cannot be written means rebuilding next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(backend.to_str(), encoding="utf-8")
        tmp.replace(path)  # whole or not at all, for a concurrent load
    except OSError:
        pass
