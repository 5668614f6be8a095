"""Building and loading the C kernels: one shared library per instruction set, chosen at run time.

The sources ship inside the package; `prepare()` compiles them with the system C compiler into a
per-user cache (once per source version) when a model is loaded, never inside a forward. Two
builds exist: `avx512vnni` (integer dot products with VNNI) where the CPU has AVX512-VNNI/VL/BW,
and `avx2` (AVX2 + FMA) otherwise; only the one this CPU runs is built (the CPU's flags are read
from /proc/cpuinfo; where there is none the AVX2 build, which runs on any AVX2 CPU, is asked), and
a build says on stderr what it compiles and roughly how long it takes before it starts. When
neither can be built, `status()` says why and a warning names the slower torch path that runs
instead. QUICKDRAFT_KERNEL=avx2|avx512vnni|torch picks one path explicitly (to compare them, or to
rule the kernel out); a choice that cannot run is an error.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = ("fused_matmul.c", "quant_matmul.c", "repack.c", "attention.c", "pool.c", "layer.c", "argmax.c", "experts.c")
HEADERS = ("kernels.h", "repack.h")
FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                   "-DQD_VNNI"],
}
ISAS = tuple(FLAGS)
FORCE_ENV = "QUICKDRAFT_KERNEL"  # avx2 | avx512vnni | torch: run that path instead of the best one
VNNI_FLAGS = ("avx512_vnni", "avx512vl", "avx512bw")  # /proc/cpuinfo's names of what the VNNI build needs
# what a build costs: ~70 s of one core (gcc -O3 on a Xeon; quant_matmul.c is 95% of it, so more cores do
# not help), 115 s with other work on the machine
BUILD_TIME = "1-2 minutes"


@dataclass(frozen=True)
class KernelInfo:
    """Which kernel runs: `isa` is None when the torch path runs, and `status` says why."""
    isa: str | None
    status: str
    path: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"isa": self.isa, "status": self.status, "path": self.path}


_libs: dict[str, ctypes.CDLL | str] = {}  # isa -> library, or the reason it could not be built
_active: KernelInfo | None = None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quickdraft" / "kernels"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.qd_fused_matmul.restype = None
    lib.qd_fused_matmul.argtypes = [p] * 5 + [i32, p, f32, p] + [i64] * 3 + [i32] * 2
    lib.qd_quant_matmul.restype = i32
    lib.qd_quant_matmul.argtypes = [p, i32, p, p, p, i32, p, p, p, i32, p, f32, p] + [i64] * 3 + [i32]
    lib.qd_rope_attention.restype = None
    lib.qd_rope_attention.argtypes = [p] * 8 + [i64] * 6 + [f32, f32, p, p, i32]
    lib.qd_layer.restype = i32
    lib.qd_layer.argtypes = [p] * 8 + [i64] * 3 + [i32]
    lib.qd_experts.restype = i32
    lib.qd_experts.argtypes = [p, p, f32] + [i64] * 4 + [p, p, i64, p, p, i32, i32, p, i32]
    lib.qd_repack.restype = i32
    lib.qd_repack.argtypes = [i32, p, i64, i64, p, i32]
    lib.qd_packed_row_bytes.restype = i64
    lib.qd_packed_row_bytes.argtypes = [i32, i64]
    lib.qd_argmax_rows.restype = None
    lib.qd_argmax_rows.argtypes = [p, i64, i64, p, i32]
    lib.qd_topk_rows.restype = None
    lib.qd_topk_rows.argtypes = [p, i64, i64, i32, p, i32]
    lib.qd_isa.restype = ctypes.c_char_p
    lib.qd_cpu_has_vnni.restype = i32
    return lib


def library(isa: str) -> ctypes.CDLL | str:
    """The library built for `isa`, or the reason it could not be built (cached either way)."""
    if isa not in _libs:
        _libs[isa] = _build(isa)
    return _libs[isa]


def _build(isa: str) -> ctypes.CDLL | str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    flags = FLAGS[isa]
    digest = hashlib.sha256(b"".join((HERE / f).read_bytes() for f in SOURCES + HEADERS)
                            + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"quickdraft-{isa}-{digest}.so"
    if not target.is_file():
        if compiler is None:
            return "no C compiler found (set CC)"
        # said before it starts: a first run is otherwise silent for as long as the compiler runs
        print(f"quickdraft: building the CPU kernels for {isa} (first use only, {BUILD_TIME})...",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        failed = _compile(compiler, flags, target)
        if failed:
            return failed
        print(f"quickdraft: CPU kernels built in {time.perf_counter() - start:.0f} s ({target})",
              file=sys.stderr, flush=True)
    try:
        return _declare(ctypes.CDLL(str(target)))
    except OSError as e:
        return f"cannot load {target.name}: {e}"


def _compile(compiler: str, flags: list[str], target: Path) -> str | None:
    """Compile every source into `target`; None, or why it failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, "-O3", *flags, "-pthread", "-shared", "-fPIC", *(str(HERE / s) for s in SOURCES),
               "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"build failed ({' '.join(cmd)}): {proc.stderr.strip()[:500]}"
        os.replace(out, target)  # atomic: concurrent builders never see half a file
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags as the Linux kernel names them; None where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def cpu_has_vnni(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU has what the avx512vnni build needs, from the kernel's flags; None where
    they cannot be read (not Linux): then the AVX2 build is built to ask the CPU itself."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else set(VNNI_FLAGS) <= flags


def _has_vnni() -> bool | None:
    """cpu_has_vnni, else the AVX2 build's answer (None: that build failed too)."""
    has = cpu_has_vnni()
    if has is None:
        base = library("avx2")
        has = None if isinstance(base, str) else bool(base.qd_cpu_has_vnni())
    return has


def prepare() -> KernelInfo:
    """Build (once) and choose the kernel for this CPU; warns when the torch path must run."""
    global _active
    if _active is None:
        _active = _choose()
        if _active.isa is None:
            warnings.warn(f"quickdraft's CPU kernels are not available ({_active.status}); quantized GGUF "
                          f"weights are dequantized per call and few-row matmuls run in torch: much slower",
                          RuntimeWarning, stacklevel=2)
    return _active


def _choose() -> KernelInfo:
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced:
        if forced == "torch":
            return KernelInfo(None, f"disabled by {FORCE_ENV}=torch")
        if forced not in ISAS:
            raise ValueError(f"{FORCE_ENV}={forced!r}: expected one of {', '.join(ISAS)} or torch")
        lib = library(forced)
        if isinstance(lib, str):
            raise RuntimeError(f"{FORCE_ENV}={forced} asks for a kernel that cannot be used: {lib}")
        if forced == "avx512vnni" and not _has_vnni():
            raise RuntimeError(f"{FORCE_ENV}=avx512vnni: this CPU lacks AVX512-VNNI/VL/BW")
        return KernelInfo(forced, f"built; chosen by {FORCE_ENV}", lib._name)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return KernelInfo(None, f"CPU capability {capability} lacks AVX2")
    isa = "avx512vnni" if _has_vnni() else "avx2"
    lib = library(isa)
    if isinstance(lib, str) and isa == "avx512vnni":  # an old compiler: AVX2 runs, and says so
        base = library("avx2")
        if isinstance(base, str):
            return KernelInfo(None, base)
        return KernelInfo("avx2", f"built; avx512vnni unavailable: {lib}", base._name)
    if isinstance(lib, str):
        return KernelInfo(None, lib)
    return KernelInfo(isa, "built", lib._name)


def active_library() -> ctypes.CDLL | None:
    info = prepare()
    return None if info.isa is None else library(info.isa)
