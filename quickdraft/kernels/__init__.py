"""`linear`: residual + prologue(x) @ W.T + b, the model's one matmul entry point.

For few rows on CPU (decode and verification) it runs a C kernel built on first use; otherwise
(prefill, CUDA, no compiler) the same math in torch. The prologue is RMSNorm or SwiGLU, fused so
a decode step runs a handful of calls per layer instead of dozens of small torch ops.

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
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("fused_matmul.c")
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
    target = _cache_dir() / f"fused_matmul-{digest}.so"
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
    lib.qd_fused_matmul.restype = None
    lib.qd_fused_matmul.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                     ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2)
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
    """The C kernel has no backward: anything autograd must see (training a head) goes to torch."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype in WEIGHT_TYPES
            and weight.is_contiguous() and x.numel() // x.shape[-1] <= MAX_ROWS and _library() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + h @ weight.T + bias, where h = x, norm_weight * RMSNorm(x) (norm = (weight, eps)),
    or silu(gate) * up for x = [..., gate | up] (swiglu). x: [..., K or 2K] -> [..., N] in x's dtype."""
    assert not (norm is not None and swiglu)
    if usable(x, weight):
        return _linear_kernel(x, weight, bias, norm, swiglu, residual)
    return _linear_torch(x, weight, bias, norm, swiglu, residual)


def _linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  norm: tuple[torch.Tensor, float] | None, swiglu: bool,
                  residual: torch.Tensor | None) -> torch.Tensor:
    h = x
    if norm is not None:
        h = norm[0] * F.rms_norm(h, (h.shape[-1],), eps=norm[1])
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    # Compute in the activations' dtype: on CPU that upcasts bfloat16/float16 weights to float32,
    # a cheap copy next to torch's bfloat16 GEMM there (6x slower on a 700-token prefill), and it
    # rounds like the kernel does. On CUDA the dtypes already agree.
    w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
    y = F.linear(h, w, None if bias is None else bias.to(h.dtype))
    return y if residual is None else residual + y


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm: tuple[torch.Tensor, float] | None, swiglu: bool,
                   residual: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    prologue, scratch, norm_weight, eps = 0, None, None, 0.0
    if norm is not None or swiglu:
        prologue = 1 if norm is not None else 2
        scratch = torch.empty(M, K, dtype=torch.float32)
    if norm is not None:
        norm_weight, eps = norm[0].float().contiguous(), norm[1]
    b = None if bias is None else bias.float().contiguous()
    r = None if residual is None else residual.reshape(M, N).float().contiguous()

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    _lib.qd_fused_matmul(x2.data_ptr(), weight.data_ptr(), ptr(b), ptr(r), y.data_ptr(), prologue,
                         ptr(norm_weight), eps, ptr(scratch), M, N, K, WEIGHT_TYPES[weight.dtype],
                         torch.get_num_threads())
    return y.view(*x.shape[:-1], N)
