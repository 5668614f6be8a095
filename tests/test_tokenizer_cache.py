"""The GGUF tokenizer's cache (tokenizer.py): the backend transformers' converter rebuilds from a
file's metadata is kept in the user's cache under a hash of that metadata, so a second load reads
it back (Gemma 3's 262k vocabulary took 8.5 s to rebuild) and a changed vocabulary is rebuilt.

Oracles: the freshly rebuilt tokenizer's encodings and decodings; the converter called or not
(patched to fail where it must not run).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers.integrations.gguf import gguf_tokenizer_mapping

from quickdraft.weights.gguf_file import open_reader, read_metadata
from quickdraft.weights.tokenizers import gguf_tokenizer
from tiny_tokenizer import tiny_model, write_llama_gguf

TEXTS = ["the cat sat on the mat", "hello world, hello", "héllo wörld ✓ 日本語 🙂", "  leading  and\ttabs\n\n",
         "<|im_start|>user\nhi<|im_end|>\n", "", "a" * 300]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "quickdraft" / "tokenizers"


@pytest.fixture(scope="module")
def meta(tmp_path_factory) -> dict:
    path = write_llama_gguf(tiny_model(), tmp_path_factory.mktemp("tok") / "m.gguf")
    return read_metadata(open_reader(path))


def converter_calls(monkeypatch) -> list[str]:
    """Records each rebuild (the converter transformers' GGUF mapping exports)."""
    calls: list[str] = []
    real = gguf_tokenizer_mapping.convert_gguf_tokenizer

    def counted(arch, fields):
        calls.append(arch)
        return real(arch, fields)
    monkeypatch.setattr(gguf_tokenizer_mapping, "convert_gguf_tokenizer", counted)
    return calls


def assert_same(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        ids = a.encode(text)
        assert a.decode(ids) == b.decode(ids), text
    assert a.token_strings() == b.token_strings()
    assert (a.eos_token_ids, a.hf.bos_token, a.hf.add_bos_token, a.hf.chat_template) == (
        b.eos_token_ids, b.hf.bos_token, b.hf.add_bos_token, b.hf.chat_template)


def test_the_second_load_reads_the_cache_and_tokenizes_identically(meta, cache, monkeypatch):
    calls = converter_calls(monkeypatch)
    built = gguf_tokenizer(meta, (7,))
    assert calls == ["llama"] and len(list(cache.glob("*.json"))) == 1
    cached = gguf_tokenizer(meta, (7,))
    assert calls == ["llama"]  # not rebuilt
    assert_same(cached, built)


def test_a_changed_vocabulary_is_rebuilt_not_served_from_the_cache(meta, cache, monkeypatch):
    """Fewer merges (a vocabulary changed past a file's first MiB would look the same to a file
    fingerprint): another key, rebuilt, and it tokenizes as its own metadata says."""
    calls = converter_calls(monkeypatch)
    old = gguf_tokenizer(meta)
    changed = {**meta, "tokenizer.ggml.merges": meta["tokenizer.ggml.merges"][:-3]}
    new = gguf_tokenizer(changed)
    assert calls == ["llama", "llama"] and len(list(cache.glob("*.json"))) == 2
    assert any(old.encode(t) != new.encode(t) for t in TEXTS)  # the premise: the change shows
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent.parent.parent / "elsewhere"))
    assert_same(new, gguf_tokenizer(changed))  # as rebuilt from nothing


def test_a_damaged_cache_file_is_rebuilt(meta, cache, monkeypatch):
    built = gguf_tokenizer(meta)
    (path,) = cache.glob("*.json")
    path.write_text('{"version": "1.0", "model": ')  # cut short
    calls = converter_calls(monkeypatch)
    assert_same(gguf_tokenizer(meta), built)
    assert calls == ["llama"] and path.read_text().endswith("}")
