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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quickdraft.kernels.build import KernelInfo, active_library, prepare
from quickdraft.kernels.layer import GATES
from quickdraft.kernels.pages import Pages
from quickdraft.kernels.quantized import ACTIVATION_BITS, KERNEL_TYPES, QuantizedWeight

__all__ = ["ACTIVATION_BITS", "KERNEL_TYPES", "KernelInfo", "MAX_ROWS", "Pages", "QuantizedWeight", "argmax", "kernel_info", "kernel_status", "linear",
           "prepare", "rope_attention", "rope_attention_usable", "TOPK_MAX", "topk_indices", "usable"]

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
           norm: tuple[torch.Tensor, float] | None = None, swiglu: bool | str = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + h @ weight.T + bias, where h = x, norm_weight * RMSNorm(x) (norm = (weight, eps)),
    or act(gate) * up for x = [..., gate | up] (swiglu: True or "silu", or another of GATES: the
    gate's activation, `gated`). x: [..., K or 2K] -> [..., N] in x's dtype."""
    assert not (norm is not None and swiglu)
    swiglu = "silu" if swiglu is True else swiglu
    assert not swiglu or swiglu in GATES, swiglu
    if isinstance(weight, QuantizedWeight):
        if quantized_usable(x):
            return _linear_quantized(x, weight, bias, norm, swiglu, residual)
        weight = weight.dequantize()
    if usable(x, weight):
        return _linear_kernel(x, weight, bias, norm, swiglu, residual)
    return _linear_torch(x, weight, bias, norm, swiglu, residual)


def gated(x: torch.Tensor, gate: str) -> torch.Tensor:
    """act(gate) * up of x = [..., gate | up] for a gate of GATES, as transformers computes it (gpt-oss's
    "swiglu_oai": (clamp(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7))."""
    g, up = x.chunk(2, dim=-1)
    if gate == "swiglu_oai":
        g, up = g.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return (up + 1) * (g * torch.sigmoid(g * 1.702))
    act = F.silu(g) if gate == "silu" else F.gelu(g, approximate="tanh" if gate == "gelu_tanh" else "none")
    return act * up


def _linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  norm: tuple[torch.Tensor, float] | None, swiglu: bool | str,
                  residual: torch.Tensor | None) -> torch.Tensor:
    h = x
    if norm is not None:
        h = norm[0] * F.rms_norm(h, (h.shape[-1],), eps=norm[1])
    if swiglu:
        h = gated(h, swiglu)
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
           swiglu: bool | str, residual: torch.Tensor | None) -> "_Call":
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        M = x2.shape[0]
        return _Call(x2, torch.empty(M, N, dtype=torch.float32), 1 if norm is not None else GATES[swiglu] if swiglu else 0,
                     None if norm is None else norm[0].float().contiguous(), 0.0 if norm is None else norm[1],
                     torch.empty(M, K, dtype=torch.float32) if norm is not None or swiglu else None,
                     None if bias is None else bias.float().contiguous(),
                     None if residual is None else residual.reshape(M, N).float().contiguous())

    @staticmethod
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()


def _linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm: tuple[torch.Tensor, float] | None, swiglu: bool | str,
                   residual: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    c, p = _Call.of(x, N, K, bias, norm, swiglu, residual), _Call.ptr
    active_library().qd_fused_matmul(c.x.data_ptr(), weight.data_ptr(), p(c.bias), p(c.residual), c.y.data_ptr(),
                                     c.prologue, p(c.norm_weight), c.eps, p(c.scratch), c.x.shape[0], N, K,
                                     WEIGHT_TYPES[weight.dtype], torch.get_num_threads())
    return c.y.view(*x.shape[:-1], N)


def _linear_quantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                      norm: tuple[torch.Tensor, float] | None, swiglu: bool | str,
                      residual: torch.Tensor | None) -> torch.Tensor:
    # Lean on purpose: a SmolLM2 decode step makes ~120 of these calls, and each torch call here
    # costs ~1 us (the model hands over float32, contiguous tensors; anything else is converted).
    N, K = weight.shape
    x2 = _f32(x.reshape(-1, x.shape[-1]))
    M = x2.shape[0]
    y = torch.empty(M, N)
    status = active_library().qd_quant_matmul(
        x2.data_ptr(), *weight.c_parts, None if bias is None else _f32(bias).data_ptr(),
        None if residual is None else _f32(residual.reshape(M, N)).data_ptr(), y.data_ptr(),
        1 if norm is not None else GATES[swiglu] if swiglu else 0, None if norm is None else _f32(norm[0]).data_ptr(),
        0.0 if norm is None else norm[1], None, M, N, K, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"quantized matmul of {M} rows x {K} could not allocate its buffers")
    return y.view(*x.shape[:-1], N)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> [...] int64: the index of the largest value along the last dimension, the first
    of equal ones (the first NaN where there is one), exactly as torch.argmax. On CPU float32 the C
    kernel runs it: torch's reduction over a few rows of a large vocabulary costs milliseconds."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or active_library() is None or x.shape[-1] == 0:
        return x.argmax(-1)
    x = x.detach().contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    active_library().qd_argmax_rows(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr(), torch.get_num_threads())
    return out


TOPK_MAX = 32  # kernels.h QD_TOPK_MAX


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., n] -> [..., k] int64: the indices of the k largest values along the last dimension,
    largest first, the lower index first among equal values. On CPU float32 the C kernel runs it
    (torch.topk over a few rows of a large vocabulary costs a few tenths of a millisecond). It never
    takes a NaN; if that leaves some row fewer than k values, torch.topk answers for the whole
    tensor (NaNs first)."""
    if not 1 <= k <= min(TOPK_MAX, x.shape[-1]) or x.device.type != "cpu" or x.dtype != torch.float32 \
            or active_library() is None:
        return x.topk(k, dim=-1).indices
    x = x.detach().contiguous()
    out = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    active_library().qd_topk_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], k, out.data_ptr(),
                                  torch.get_num_threads())
    if (out[..., -1] < 0).any():
        return x.topk(k, dim=-1).indices
    return out


def rope_attention_usable(qkv: torch.Tensor, cache_dtype: torch.dtype) -> bool:
    if torch.is_grad_enabled() and qkv.requires_grad:
        return False
    return (qkv.device.type == "cpu" and qkv.dtype == torch.float32 and cache_dtype == torch.float32
            and active_library() is not None)


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   pages: Pages, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, kv_len: int,
                   n_q: int, n_kv: int, scale: float | None = None, softcap: float | None = None,
                   rows: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention half of a layer in one C call (attention.c): rotary embedding of q and k, k and v
    written to the cache at `positions`, each query attending alone over the keys it may see, so its
    output does not depend on the batch it is in.
    qkv [B, T, (n_q + 2 n_kv) * D]; cos, sin [B, 1, T, D]; positions [B, T]; pages: the cache's block
    tables, k, v [blocks, n_kv, block, D] the layer's pools (a cache of rows [B, n_kv, max_len, D]
    is `Pages.rows(B, max_len)` over them); visible [B, T, kv_len] (True = may attend) or None
    (causal: each token sees its row's keys at slots 0..its position); scale: the scores' (None:
    D ** -0.5); softcap: scores become softcap * tanh(score / softcap) (None: not capped); rows
    [B * T] int64: each token's cache row (a ragged pass, B = 1), None: its batch row; sinks [n_q]: a
    logit per query head that joins its softmax's denominator only (gpt-oss), None: none
    -> [B, T, n_q * D]."""
    B, T, _ = qkv.shape
    D = k.shape[-1]
    address = pages.bind(k, v)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty(B, T, n_q * D, dtype=torch.float32)
    scratch = torch.empty(B * T * n_q * D, dtype=torch.float32)
    if sinks is not None and sinks.numel() != n_q:  # the kernel reads one per query head
        raise ValueError(f"{sinks.numel()} attention sinks for {n_q} query heads")
    sinks = None if sinks is None else _f32(sinks)
    active_library().qd_rope_attention(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), None if rows is None else rows.data_ptr(),
        address, None if visible is None else visible.data_ptr(), out.data_ptr(), B, T, n_q, n_kv, D, kv_len,
        D ** -0.5 if scale is None else scale, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
        scratch.data_ptr(), torch.get_num_threads())
    return out
