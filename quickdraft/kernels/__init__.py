"""`linear`: residual + prologue(x) @ W.T + b, the model's one matmul entry point.

For few rows on CPU (decode and verification) float weights go to a C kernel; quantized GGUF
weights (`QuantizedWeight`) go to the integer kernel at any row count; otherwise (prefill of float
weights, CUDA, no compiler) the same math runs in torch. The prologue is RMSNorm or SwiGLU, fused
so a decode step runs a handful of calls per layer instead of dozens of small torch ops.

MKL's skinny GEMMs read the weights once per input row on some CPUs (AMD EPYC here), so
verifying k+1 tokens cost k+1 decode steps. The kernels read each weight row once for all
rows and reduce every output in a fixed order (bitwise batch-invariant). They are built by
`prepare()` when a model is loaded (build.py); `kernel_info()` says which instruction set runs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quickdraft.kernels.build import KernelInfo, active_library, prepare
from quickdraft.kernels.quantized import KERNEL_TYPES, QuantizedWeight

__all__ = ["KERNEL_TYPES", "KernelInfo", "MAX_ROWS", "QuantizedWeight", "attention", "kernel_info",
           "kernel_status", "linear", "prepare", "usable"]

WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_ROWS = 64  # above this float weights are compute-bound and MKL's blocked GEMM wins


def kernel_info() -> KernelInfo:
    return prepare()


def kernel_status() -> str:
    return prepare().status


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The C kernel has no backward: anything autograd must see (training a head) goes to torch."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype in WEIGHT_TYPES
            and weight.is_contiguous() and x.numel() // x.shape[-1] <= MAX_ROWS and active_library() is not None)


def quantized_usable(x: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return x.device.type == "cpu" and x.dtype == torch.float32 and active_library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + h @ weight.T + bias, where h = x, norm_weight * RMSNorm(x) (norm = (weight, eps)),
    or silu(gate) * up for x = [..., gate | up] (swiglu). x: [..., K or 2K] -> [..., N] in x's dtype."""
    assert not (norm is not None and swiglu)
    if isinstance(weight, QuantizedWeight):
        if quantized_usable(x):
            return _linear_quantized(x, weight, bias, norm, swiglu, residual)
        weight = weight.dequantize()
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


@dataclass(frozen=True)
class _Call:
    """The arguments both C matmuls share: rows, output, prologue, bias and residual (as pointers)."""
    x: torch.Tensor         # [M, K or 2K] contiguous
    y: torch.Tensor         # [M, N]
    prologue: int
    norm_weight: torch.Tensor | None
    eps: float
    scratch: torch.Tensor | None
    bias: torch.Tensor | None
    residual: torch.Tensor | None

    @staticmethod
    def of(x: torch.Tensor, N: int, K: int, bias: torch.Tensor | None, norm: tuple[torch.Tensor, float] | None,
           swiglu: bool, residual: torch.Tensor | None) -> "_Call":
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        M = x2.shape[0]
        return _Call(x2, torch.empty(M, N, dtype=torch.float32), 1 if norm is not None else 2 if swiglu else 0,
                     None if norm is None else norm[0].float().contiguous(), 0.0 if norm is None else norm[1],
                     torch.empty(M, K, dtype=torch.float32) if norm is not None or swiglu else None,
                     None if bias is None else bias.float().contiguous(),
                     None if residual is None else residual.reshape(M, N).float().contiguous())

    @staticmethod
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm: tuple[torch.Tensor, float] | None, swiglu: bool,
                   residual: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    c, p = _Call.of(x, N, K, bias, norm, swiglu, residual), _Call.ptr
    active_library().qd_fused_matmul(c.x.data_ptr(), weight.data_ptr(), p(c.bias), p(c.residual), c.y.data_ptr(),
                                     c.prologue, p(c.norm_weight), c.eps, p(c.scratch), c.x.shape[0], N, K,
                                     WEIGHT_TYPES[weight.dtype], torch.get_num_threads())
    return c.y.view(*x.shape[:-1], N)


def _linear_quantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                      norm: tuple[torch.Tensor, float] | None, swiglu: bool,
                      residual: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    c, p = _Call.of(x, N, K, bias, norm, swiglu, residual), _Call.ptr
    n = len(weight.parts)
    types = (ctypes.c_int * n)(*(int(part.qtype) for part in weight.parts))
    rows = (ctypes.c_int64 * n)(*(part.rows for part in weight.parts))
    data = (ctypes.c_void_p * n)(*(part.blocks.ctypes.data for part in weight.parts))
    status = active_library().qd_quant_matmul(
        c.x.data_ptr(), n, types, rows, data, p(c.bias), p(c.residual), c.y.data_ptr(), c.prologue,
        p(c.norm_weight), c.eps, p(c.scratch), c.x.shape[0], N, K, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"quantized matmul of {c.x.shape[0]} rows x {K} could not allocate its buffers")
    return c.y.view(*x.shape[:-1], N)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, T, D], keys/values [B, Hkv, kv_len, D] (views of the cache), mask [B, 1, T, kv_len]
    (True = may attend) or None (all) -> [B, T, Hq * D]. On CPU in float32 each query is computed
    alone (attention.c), so its output does not depend on the batch it is in; else torch's SDPA."""
    B, Hq, T, D = q.shape
    Hkv, kv_len = keys.shape[1], keys.shape[2]
    lib = active_library() if q.device.type == "cpu" and q.dtype == torch.float32 else None
    if lib is None or torch.is_grad_enabled() and q.requires_grad or keys.stride()[2:] != (D, 1) \
            or values.stride() != keys.stride():
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=Hkv != Hq)
        return out.transpose(1, 2).reshape(B, T, Hq * D)
    qc = q.transpose(1, 2).contiguous()  # [B, T, Hq, D]
    out = torch.empty(B, T, Hq * D, dtype=torch.float32)
    visible = None if mask is None else mask[:, 0].contiguous()
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, kv_len, dtype=torch.float32)
    lib.qd_attention(qc.data_ptr(), keys.data_ptr(), values.data_ptr(),
                     None if visible is None else visible.data_ptr(), out.data_ptr(), B, T, Hq, Hkv, D, kv_len,
                     keys.stride(0), keys.stride(1), D ** -0.5, scratch.data_ptr(), threads)
    return out
