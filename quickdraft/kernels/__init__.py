"""A CPU matmul for few rows (decode and verification), built from C on first use.

MKL's skinny GEMMs read the weights once per input row on some CPUs (AMD EPYC here), so
verifying k+1 tokens cost k+1 decode steps. This kernel reads each weight row once for all
rows and reduces every output in a fixed order (bitwise batch-invariant). Built with the
system C compiler into a per-user cache; where that cannot happen (no compiler, no AVX2)
torch's own matmul is used and `kernel_status()` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("skinny_matmul.c")
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_ROWS = 64  # above this the matmul is compute-bound and MKL's blocked GEMM wins

_lib: ctypes.CDLL | None = None
_status = "not built yet"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quickdraft" / "kernels"


def _build() -> ctypes.CDLL | None:
    global _status
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _status = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2; using torch.matmul"
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / f"skinny_matmul-{digest}.so"
    if not target.is_file():
        if compiler is None:
            _status = "no C compiler found (set CC); using torch.matmul"
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC",
                   str(SOURCE), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                _status = f"kernel build failed ({' '.join(cmd)}): {proc.stderr.strip()[:500]}"
                return None
            os.replace(out, target)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(target))
    lib.qd_skinny_matmul.restype = None
    lib.qd_skinny_matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    _status = f"built ({target.name})"
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _status
    if _lib is None and _status == "not built yet":
        _lib = _build()
    return _lib


def kernel_status() -> str:
    _library()
    return _status


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.dtype in WEIGHT_TYPES and weight.is_contiguous()
            and x.numel() // x.shape[-1] <= MAX_ROWS and _library() is not None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N] in x's dtype; accumulates in float32."""
    lib = _library()
    assert lib is not None and weight.is_contiguous()
    N, K = weight.shape
    x2 = x.reshape(-1, K).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    lib.qd_skinny_matmul(x2.data_ptr(), weight.data_ptr(), b.data_ptr() if b is not None else None,
                         y.data_ptr(), x2.shape[0], N, K, WEIGHT_TYPES[weight.dtype], torch.get_num_threads())
    return y.view(*x.shape[:-1], N).to(x.dtype)
