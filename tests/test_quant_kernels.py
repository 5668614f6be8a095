"""The integer kernel over GGUF blocks (quant_matmul.c) and the per-query attention (attention.c).

Oracles: gguf's own dequantization of the same blocks times the activations quantized to int16 as
the kernel documents (blocks of 256, scale max|x| / 8191, round to nearest even), in float64: equal
within float32 rounding; the unquantized activations: within the int16 step (documented below);
and the kernel itself at other row counts: bitwise equal (what makes verification match decoding).
The kernel must be built: these tests fail, not skip, where it is not.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from quickdraft import kernels
from quickdraft.kernels import QuantizedWeight
from quickdraft.kernels.build import library
from quickdraft.kernels.quantized import Part
from tiny_models import K_QUANTS, random_k_blocks

TYPES = sorted(kernels.KERNEL_TYPES, key=lambda t: t.value)
ROWS = [1, 2, 7, 16, 64]
X_MAX = 8191
# int16 activations in blocks of 256 cost at most half a step (max|x| / 16382) per value: ~1e-4 of
# max |y| over random rows. The bound leaves room, and a wrong block layout errs by ~100%.
UNQUANTIZED_TOL = 1e-3


def weight(qtype: Q, N: int = 48, K: int | None = None, seed: int = 0) -> QuantizedWeight:
    K = K or (512 if qtype in K_QUANTS else 576)  # 576: a last activation block of 64 values
    if qtype in K_QUANTS:
        blocks = random_k_blocks(N, K, qtype, std=0.05, seed=seed)
    else:
        blocks = quantize(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05, qtype)
    return QuantizedWeight([Part(qtype, blocks)], K)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel sees it: dx * xq per block of 256 (float64)."""
    x = x.float().numpy()
    out = np.zeros(x.shape, dtype=np.float64)
    for k0 in range(0, x.shape[1], 256):
        blk = x[:, k0:k0 + 256]
        amax = np.abs(blk).max(axis=1, keepdims=True).astype(np.float32)
        iscale = np.where(amax > 0, np.float32(X_MAX) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
        xq = np.rint(blk * iscale.astype(np.float32))
        out[:, k0:k0 + 256] = xq * (amax / np.float32(X_MAX)).astype(np.float64)
    return torch.from_numpy(out)


def test_kernel_is_built_and_active():
    info = kernels.kernel_info()
    assert info.isa in ("avx2", "avx512vnni"), info.status


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_equals_dequantized_reference(qtype):
    w = weight(qtype)
    W = w.dequantize().double()  # gguf's dequantization
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(1))
    y = kernels.linear(x, w).double()
    exact = quantized_rows(x) @ W.T
    scale = exact.abs().max()
    assert (y - exact).abs().max() <= 1e-5 * scale, (y - exact).abs().max() / scale
    assert (y - x.double() @ W.T).abs().max() <= UNQUANTIZED_TOL * scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_row_is_bitwise_the_same_for_any_row_count(qtype):
    w = weight(qtype)
    x = torch.randn(max(ROWS) + 36, w.shape[1], generator=torch.Generator().manual_seed(2))  # 100: 2 chunks
    full = kernels.linear(x, w)
    for m in ROWS:
        for start in (0, 3, 35):
            assert torch.equal(kernels.linear(x[start:start + m], w), full[start:start + m]), (m, start)


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
def test_fused_prologue_bias_and_residual(prologue):
    w = weight(Q.Q4_K, N=40)
    N, K = w.shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * K if prologue == "swiglu" else K, generator=g)
    bias, residual = torch.randn(N, generator=g), torch.randn(7, N, generator=g)
    norm = (torch.rand(K, generator=g) + 0.5, 1e-5) if prologue == "rmsnorm" else None
    y = kernels.linear(x, w, bias, norm=norm, swiglu=prologue == "swiglu", residual=residual)
    h = x
    if norm is not None:
        h = norm[0] * F.rms_norm(x, (K,), eps=norm[1])
    elif prologue == "swiglu":
        h = F.silu(x[:, :K]) * x[:, K:]
    ref = residual + h @ w.dequantize().T + bias
    assert (y - ref).abs().max() <= UNQUANTIZED_TOL * (ref - residual).abs().max()


def test_parts_of_several_types_are_one_matrix():
    """Q4_K_M stores q|k in Q4_K and v in Q6_K: the fused matrix is its parts side by side."""
    parts = [weight(Q.Q4_K, N=32, seed=4), weight(Q.Q6_K, N=16, seed=5)]
    fused = QuantizedWeight.cat(parts)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    assert fused.shape == (48, 512) and fused.types == "Q4_K+Q6_K"
    assert torch.equal(kernels.linear(x, fused), torch.cat([kernels.linear(x, p) for p in parts], dim=1))
    assert torch.equal(fused[[0, 40]], torch.stack([parts[0].dequantize()[0], parts[1].dequantize()[8]]))


def test_both_instruction_sets_agree_bitwise():
    """VNNI's vpdpwssd and AVX2's vpmaddwd + vpaddd sum the same integers: one result."""
    vnni = library("avx512vnni")
    if not library("avx2").qd_cpu_has_vnni():
        pytest.skip("this CPU lacks AVX512-VNNI: only the AVX2 build can run here")
    assert not isinstance(vnni, str), vnni
    w, x = weight(Q.Q4_K), torch.randn(9, 512)
    results = []
    for isa in ("avx2", "avx512vnni"):
        y = torch.empty(9, w.shape[0])
        part = w.parts[0]
        library(isa).qd_quant_matmul(x.data_ptr(), 1, (ctypes.c_int * 1)(int(part.qtype)),
                                     (ctypes.c_int64 * 1)(part.rows), (ctypes.c_void_p * 1)(part.blocks.ctypes.data),
                                     None, None, y.data_ptr(), 0, None, 0.0, None, 9, w.shape[0], 512, 1)
        results.append(y)
    assert torch.equal(*results)


def attention_case(B=2, Hq=4, Hkv=2, T=5, kv_len=12, D=24, seed=7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g)
    cache_k = torch.randn(B, Hkv, 32, D, generator=g)  # a cache buffer longer than kv_len, as the model's
    cache_v = torch.randn(B, Hkv, 32, D, generator=g)
    positions = torch.arange(kv_len - T, kv_len).expand(B, T)
    mask = (torch.arange(kv_len) <= positions[..., None])[:, None]  # [B, 1, T, kv_len], causal
    return q, cache_k[:, :, :kv_len], cache_v[:, :, :kv_len], mask


def test_attention_equals_sdpa():
    q, k, v, mask = attention_case()
    out = kernels.attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).reshape(out.shape)
    assert torch.allclose(out, ref, atol=1e-5)


def test_attention_of_a_query_does_not_depend_on_the_others():
    q, k, v, mask = attention_case()
    full = kernels.attention(q, k, v, mask)  # [B, T, Hq * D]
    for t in range(q.shape[2]):  # each query alone: one row, its own mask, a shorter kv_len
        n = int(mask[0, 0, t].sum())
        alone = kernels.attention(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], None)
        assert torch.equal(alone[:, 0], full[:, t]), t
