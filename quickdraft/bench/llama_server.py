"""llama.cpp's own HTTP server (`llama-server`) for the benchmarks that compare servers: built once
from the llama-cpp-python sdist that the `llamacpp` extra pins (its vendored llama.cpp, CMake, the
llama-server target only), cached under the user's cache directory; and how it is launched: on a
CPU with AMX through amx_guard.py, which keeps it off its AMX kernels (without the guard it dies of
SIGILL at its first pass on the project's Intel machine, as the binding's AMX kernels crash).

Knows pip, CMake and how llama-server starts; nothing of quickdraft's engine.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from importlib import metadata
from pathlib import Path
from typing import Callable

from quickdraft.bench.amx_guard import has_amx
from quickdraft.errors import QuickdraftError

DISTRIBUTION = "llama-cpp-python"
# Release, tuned for this CPU as pip's build of the binding is (GGML_NATIVE); a static binary that
# needs nothing at run time: no TLS, no web UI (its prebuilt assets would be a download), no tests
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DBUILD_SHARED_LIBS=OFF")

AMX_GUARD = Path(__file__).with_name("amx_guard.py")  # run by path: it imports nothing of quickdraft

Log = Callable[[str], None]


def pinned_version() -> str:
    """The llama-cpp-python version quickdraft's `llamacpp` extra pins (pyproject.toml), read from the
    installed package's metadata so that the two never disagree."""
    try:
        requires = metadata.requires("quickdraft") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        name, _, rest = req.partition("==")
        if name.strip().lower() == DISTRIBUTION and rest:
            return rest.split(";")[0].strip()
    raise QuickdraftError(f"quickdraft's metadata pins no {DISTRIBUTION} version (expected "
                          f"'{DISTRIBUTION}==X' in the llamacpp extra); reinstall quickdraft (pip install -e .)")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quickdraft" / "llama-server"


def server_path(version: str) -> Path:
    return cache_dir() / version / "llama-server"


def ensure_llama_server(log: Log, jobs: int = 2) -> Path:
    """The cached llama-server of the pinned version; built first when missing (minutes)."""
    version = pinned_version()
    path = server_path(version)
    if path.is_file() and os.access(path, os.X_OK):
        return path
    log(f"building llama-server from {DISTRIBUTION} {version}'s llama.cpp (once; 5-15 minutes on 2 cores) "
        f"into {path.parent}")
    build_llama_server(version, path, log, jobs)
    return path


def _require_tools() -> str:
    """CMake and a C++ compiler, or an error naming what is missing; the CMake generator to use."""
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise QuickdraftError(f"building llama-server needs {' and '.join(missing)}, not found on PATH "
                              f"(e.g. apt-get install cmake g++)")
    return "Ninja" if shutil.which("ninja") else "Unix Makefiles"


def _run(cmd: list[str], what: str, log: Log) -> None:
    """Run a build step; every 20th of its progress lines ("[40/206] ...") reaches the log, and the
    last 30 lines of its output are the error when it fails."""
    log(f"{what}: {' '.join(cmd)}")
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail.append(line.rstrip())
            step = re.match(r"\[(\d+)/(\d+)\]", line)
            if step and int(step[1]) % 20 == 0:
                log(f"  {line.strip()[:100]}")
    if proc.returncode != 0:
        raise QuickdraftError(f"{what} failed (exit code {proc.returncode}):\n" + "\n".join(tail))


def _llama_cpp_source(version: str, work: Path, log: Log) -> Path:
    """The sdist's vendored llama.cpp, downloaded with pip (the project's registry client) and unpacked."""
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
          f"{DISTRIBUTION}=={version}", "-d", str(work)], f"downloading the {DISTRIBUTION} {version} sdist", log)
    archives = list(work.glob("*.tar.gz"))
    if len(archives) != 1:
        raise QuickdraftError(f"expected one sdist archive from pip download, found {[a.name for a in archives]}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("*/vendor/llama.cpp"), None)
    if source is None or not (source / "tools" / "server").is_dir():
        raise QuickdraftError(f"the {DISTRIBUTION} {version} sdist holds no vendor/llama.cpp with tools/server")
    return source


def build_llama_server(version: str, dest: Path, log: Log, jobs: int = 2) -> None:
    """Configure the sdist's llama.cpp and build only llama-server; copy the binary to `dest`
    (written beside it first, then renamed: a build cut short leaves no half binary there)."""
    generator = _require_tools()
    with tempfile.TemporaryDirectory(prefix="quickdraft-llama-server-") as tmp:
        work = Path(tmp)
        source = _llama_cpp_source(version, work, log)
        build = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build), "-G", generator, *CMAKE_OPTIONS],
             "configuring llama.cpp", log)
        _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"],
             "compiling llama-server", log)
        binary = build / "bin" / "llama-server"
        if not binary.is_file():
            raise QuickdraftError(f"the build finished without {binary}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        shutil.copy2(binary, partial)
        partial.replace(dest)
    log(f"built {dest}")


def launch_command(binary: Path, args: list[str]) -> list[str]:
    """The command that starts llama-server with `args`: through the AMX guard where AMX is present."""
    return [sys.executable, str(AMX_GUARD), str(binary), *args] if has_amx() else [str(binary), *args]
