"""The integer kernel over GGUF blocks (quant_matmul.c) and the per-query attention (attention.c).

Oracles: gguf's own dequantization of the same blocks times the activations quantized as the kernel
documents (int16: blocks of 256, scale max|x| / 8191; int8: blocks of 32, scale max|x| / 127; round
to nearest even), in float64: equal within float32 rounding; the unquantized activations: within
the rounding step (documented below);
and the kernel itself at other row counts: bitwise equal (what makes verification match decoding).
The kernel must be built: these tests fail, not skip, where it is not.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

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
BITS = [16, 8]
# activation bits -> (values per scale, largest quantized value)
ROUNDING = {16: (256, 8191), 8: (32, 127)}
# int16 activations in blocks of 256 cost at most half a step (max|x| / 16382) per value: ~1e-4 of
# max |y| over random rows; int8 in blocks of 32 (max|x| / 254 per value): ~6e-3 measured. The
# bounds leave room, and a wrong block layout errs by ~100%.
UNQUANTIZED_TOL = {16: 1e-3, 8: 2e-2}


def weight(qtype: Q, N: int = 48, K: int | None = None, seed: int = 0, bits: int = 16) -> QuantizedWeight:
    K = K or (512 if qtype in K_QUANTS else 576)  # 576: a last activation block of 64 values
    if qtype in K_QUANTS:
        blocks = random_k_blocks(N, K, qtype, std=0.05, seed=seed)
    else:
        blocks = quantize(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05, qtype)
    return QuantizedWeight([Part(qtype, blocks)], K, bits)


def quantized_rows(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x [M, K] as the kernel sees it: dx * xq per block (float64)."""
    block, x_max = ROUNDING[bits]
    x = x.float().numpy()
    out = np.zeros(x.shape, dtype=np.float64)
    for k0 in range(0, x.shape[1], block):
        blk = x[:, k0:k0 + block]
        amax = np.abs(blk).max(axis=1, keepdims=True).astype(np.float32)
        iscale = np.where(amax > 0, np.float32(x_max) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
        xq = np.rint(blk * iscale.astype(np.float32))
        out[:, k0:k0 + block] = xq * (amax / np.float32(x_max)).astype(np.float64)
    return torch.from_numpy(out)


def test_kernel_is_built_and_active():
    info = kernels.kernel_info()
    assert info.isa in ("avx2", "avx512vnni"), info.status


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_equals_dequantized_reference(qtype, bits):
    w = weight(qtype, bits=bits)
    W = w.dequantize().double()  # gguf's dequantization
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(1))
    x[3, :40] = 0.0  # a unit of zeros (int8: a zero scale) and a unit partly zero
    y = kernels.linear(x, w).double()
    exact = quantized_rows(x, bits) @ W.T
    scale = exact.abs().max()
    assert (y - exact).abs().max() <= 1e-5 * scale, (y - exact).abs().max() / scale
    assert (y - x.double() @ W.T).abs().max() <= UNQUANTIZED_TOL[bits] * scale
    # the premise of the oracle: the two roundings differ by more than the tolerance allows
    other = quantized_rows(x, 24 - bits) @ W.T
    assert (other - exact).abs().max() > 1e-4 * scale


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_row_is_bitwise_the_same_for_any_row_count(qtype, bits):
    w = weight(qtype, bits=bits)
    x = torch.randn(max(ROWS) + 36, w.shape[1], generator=torch.Generator().manual_seed(2))  # 100: 2 chunks
    full = kernels.linear(x, w)
    for m in ROWS:
        for start in (0, 3, 35):
            assert torch.equal(kernels.linear(x[start:start + m], w), full[start:start + m]), (m, start)


GATES = {"swiglu": (True, F.silu), "geglu_tanh": ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh")),
         "geglu_erf": ("gelu", F.gelu), "swiglu_oai": ("swiglu_oai", None)}


def oai_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate of [gate | up] (taken apart, not interleaved)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", *GATES])
def test_fused_prologue_bias_and_residual(prologue):
    w = weight(Q.Q4_K, N=40)
    N, K = w.shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * K if prologue in GATES else K, generator=g) * (6 if prologue == "swiglu_oai" else 1)
    bias, residual = torch.randn(N, generator=g), torch.randn(7, N, generator=g)
    norm = (torch.rand(K, generator=g) + 0.5, 1e-5) if prologue == "rmsnorm" else None
    gate, act = GATES.get(prologue, (False, None))
    y = kernels.linear(x, w, bias, norm=norm, swiglu=gate, residual=residual)
    y8 = kernels.linear(x, w.with_activations(8), bias, norm=norm, swiglu=gate, residual=residual)
    h = x
    if norm is not None:
        h = norm[0] * F.rms_norm(x, (K,), eps=norm[1])
    elif prologue == "swiglu_oai":  # (x spread so that the clamps bite)
        assert (x.abs() > 7).float().mean() > 0.2
        h = oai_reference(x)
    elif act is not None:
        h = act(x[:, :K]) * x[:, K:]
    ref = residual + h @ w.dequantize().T + bias
    assert (y - ref).abs().max() <= UNQUANTIZED_TOL[16] * (ref - residual).abs().max()
    assert (y8 - ref).abs().max() <= UNQUANTIZED_TOL[8] * (ref - residual).abs().max()


def test_parts_of_several_types_are_one_matrix():
    """Q4_K_M stores q|k in Q4_K and v in Q6_K: the fused matrix is its parts side by side."""
    parts = [weight(Q.Q4_K, N=32, seed=4), weight(Q.Q6_K, N=16, seed=5)]
    fused = QuantizedWeight.cat(parts)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    assert fused.shape == (48, 512) and fused.types == "Q4_K+Q6_K"
    assert torch.equal(kernels.linear(x, fused), torch.cat([kernels.linear(x, p) for p in parts], dim=1))
    assert torch.equal(fused[[0, 40]], torch.stack([parts[0].dequantize()[0], parts[1].dequantize()[8]]))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_both_instruction_sets_agree_bitwise(qtype, bits):
    """VNNI's vpdpwssd and AVX2's vpmaddwd + vpaddd sum the same integers, in register layouts
    that differ with the row count (more accumulator chains for fewer rows): one result; and so
    do VNNI's vpdpbusd and AVX2's vpmaddubsw sums for int8 activations. The repacked layout
    (repack.c) is the same for both builds."""
    vnni = library("avx512vnni")
    if not library("avx2").qd_cpu_has_vnni():
        pytest.skip("this CPU lacks AVX512-VNNI: only the AVX2 build can run here")
    assert not isinstance(vnni, str), vnni
    w = weight(qtype)
    part, (N, K) = w.parts[0], w.shape
    for M in (1, 2, 3, 9, 12, 13, 17):  # row groups: AVX2 takes at most 8 rows a pass, VNNI 12
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        results = []
        for isa in ("avx2", "avx512vnni"):
            y = torch.empty(M, N)
            library(isa).qd_quant_matmul(x.data_ptr(), 1, (ctypes.c_int * 1)(int(part.qtype)),
                                         (ctypes.c_int64 * 1)(part.rows), (ctypes.c_void_p * 1)(part.packed.ctypes.data),
                                         int(bits == 8), None, None, y.data_ptr(), 0, None, 0.0, None, M, N, K, 1)
            results.append(y)
        assert torch.equal(*results), M


def kernel_chosen_with(value: str) -> subprocess.CompletedProcess:
    code = "from quickdraft import kernels; print(kernels.kernel_info().isa)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "QUICKDRAFT_KERNEL": value})


def test_the_kernel_can_be_chosen_explicitly():
    assert kernel_chosen_with("avx2").stdout.split() == ["avx2"]
    torch_path = kernel_chosen_with("torch")
    assert torch_path.stdout.split() == ["None"] and "QUICKDRAFT_KERNEL=torch" in torch_path.stderr
    wrong = kernel_chosen_with("sse9")
    assert wrong.returncode != 0 and "QUICKDRAFT_KERNEL='sse9': expected one of avx2, avx512vnni" in wrong.stderr


# head widths: 64 and 128 keep the output in registers, others take the general loop; contexts: a
# partial block of 8 keys only, and whole blocks plus a partial one (the softmax goes 8 keys at a time)
ATTENTION_SHAPES = [(24, 7), (64, 7), (64, 40), (128, 40)]


def attention_case(B=2, Hq=4, Hkv=2, T=5, ctx=7, D=24, seed=7):
    """A pass of T new tokens after ctx cached ones, per batch row: qkv, rotary tables, positions,
    cache buffers (longer than needed, as the model's) holding random K/V for the context."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g)
    positions = torch.arange(ctx, ctx + T).expand(B, T).contiguous()
    angles = positions[..., None].float() * torch.rand(D // 2, generator=g)
    emb = torch.cat((angles, angles), -1)[:, None]  # [B, 1, T, D]
    k_cache, v_cache = torch.randn(B, Hkv, 64, D, generator=g), torch.randn(B, Hkv, 64, D, generator=g)
    return qkv, emb.cos(), emb.sin(), positions, k_cache, v_cache


def attend(qkv, cos, sin, positions, k_cache, v_cache, visible, kv_len, n_q, n_kv, **options):
    """kernels.rope_attention over cache rows k_cache, v_cache [B, n_kv, max_len, D] (a pool whose
    blocks are the rows)."""
    pages = kernels.Pages.rows(k_cache.shape[0], k_cache.shape[2])
    return kernels.rope_attention(qkv, cos, sin, positions, pages, k_cache, v_cache, visible, kv_len, n_q, n_kv,
                                  **options)


def paged(k_cache, v_cache, block=16, seed=0):
    """The same rows cut into blocks of `block` slots, stored at shuffled places of a pool whose
    block 0 no table names -> (Pages' tables, k pool, v pool, gather: pool -> rows)."""
    B, H, L, D = k_cache.shape
    width = L // block
    ids = (torch.randperm(B * width, generator=torch.Generator().manual_seed(seed)) + 1).to(torch.int32)
    tables = ids.view(B, width).contiguous()

    def scatter(rows):
        pool = torch.full((B * width + 1, H, block, D), float("nan"))
        pool[tables.flatten().long()] = rows.view(B, H, width, block, D).transpose(1, 2).reshape(-1, H, block, D)
        return pool

    def gather(pool):
        return pool[tables.long()].transpose(1, 2).reshape(B, H, L, D)
    return tables, scatter(k_cache), scatter(v_cache), gather


def torch_reference(qkv, cos, sin, positions, k_cache, v_cache, Hq=4, Hkv=2):
    """Rotate-half RoPE, cache writes and SDPA in torch, as the model's non-CPU path does."""
    from quickdraft.model.rope import apply_rope
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    x = qkv.view(B, T, Hq + 2 * Hkv, D).transpose(1, 2)
    q, k = apply_rope(x[:, :Hq + Hkv], cos, sin).split((Hq, Hkv), dim=1)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for b in range(B):
        k_cache[b, :, positions[b]] = k[b]
        v_cache[b, :, positions[b]] = x[b, Hq + Hkv:]
    kv_len = int(positions.max()) + 1
    mask = (torch.arange(kv_len) <= positions[..., None])[:, None]
    out = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(B, T, Hq * D), k_cache, v_cache


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
def test_rope_attention_equals_torch(D, ctx):
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(D=D, ctx=ctx)
    ref, ref_k, ref_v = torch_reference(qkv, cos, sin, positions, k_cache, v_cache)
    kv_len = int(positions.max()) + 1
    mask = (torch.arange(kv_len) <= positions[..., None]).contiguous()
    out = attend(qkv, cos, sin, positions, k_cache, v_cache, mask, kv_len, 4, 2)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(k_cache, ref_k, atol=1e-6) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
def test_attention_of_a_query_does_not_depend_on_the_others(D, ctx):
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(D=D, ctx=ctx)
    kv_len = int(positions.max()) + 1
    mask = (torch.arange(kv_len) <= positions[..., None]).contiguous()
    full = attend(qkv, cos, sin, positions, k_cache.clone(), v_cache.clone(), mask, kv_len, 4, 2)
    k_step, v_step = k_cache.clone(), v_cache.clone()
    for t in range(qkv.shape[1]):  # one token at a time, as decoding feeds them: no mask, a shorter kv_len
        n = int(positions[0, t]) + 1
        alone = attend(qkv[:, t:t + 1], cos[:, :, t:t + 1], sin[:, :, t:t + 1], positions[:, t:t + 1],
                                       k_step, v_step, None, n, 4, 2)
        assert torch.equal(alone[:, 0], full[:, t]), t


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
def test_a_tree_nodes_attention_equals_its_paths_decode(D, ctx):
    """A tree's node sees the cache and its ancestors, which sit among masked siblings (slots with
    gaps); decoding the same path puts them in consecutive slots. The node's output must be
    bitwise the same, or greedy tree speculation could flip a near-tie plain decoding does not."""
    parents = [-1, -1, 1, -1, 2, 2, 4]  # node 6's path: 1, 2, 4, 6 at slots ctx + 1, 2, 4, 6
    T = len(parents)
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    qkv, cos, sin, _, k_cache, v_cache = attention_case(B=1, T=T, ctx=ctx, D=D)
    slots = torch.arange(ctx, ctx + T)[None]
    visible = torch.zeros(1, T, ctx + T, dtype=torch.bool)
    visible[..., :ctx] = True
    for i in range(T):
        n = i
        while n >= 0:
            visible[0, i, ctx + n] = True
            n = parents[n]
    tree = attend(qkv, cos, sin, slots, k_cache.clone(), v_cache.clone(), visible, ctx + T, 4, 2)
    path = [1, 2, 4, 6]
    assert [depth[n] for n in path] == [1, 2, 3, 4]  # the premise: a chain once its siblings are gone
    k_step, v_step = k_cache.clone(), v_cache.clone()
    for j, n in enumerate(path):  # decoding the path: one token a step, consecutive slots, no mask
        alone = attend(qkv[:, n:n + 1], cos[:, :, n:n + 1], sin[:, :, n:n + 1],
                                       torch.tensor([[ctx + j]]), k_step, v_step, None, ctx + j + 1, 4, 2)
        assert torch.equal(alone[:, 0], tree[:, n]), (n, float((alone[:, 0] - tree[:, n]).abs().max()))


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
def test_soft_capped_scores_equal_transformers_eager_attention_and_stay_batch_invariant(D, ctx):
    """Gemma 2's scores: cap * tanh(q.k * scale / cap) before the mask and softmax, as transformers'
    eager attention computes them; a query's output alone equals its output among the others."""
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(D=D, ctx=ctx)
    qkv = qkv * 4  # scores large enough that the cap bites
    _, ref_k, ref_v = torch_reference(qkv, cos, sin, positions, k_cache, v_cache)
    B, T, _ = qkv.shape
    kv_len = int(positions.max()) + 1
    mask = (torch.arange(kv_len) <= positions[..., None]).contiguous()
    cap, scale = 3.0, 0.3
    k_pass, v_pass = k_cache.clone(), v_cache.clone()
    out = attend(qkv, cos, sin, positions, k_pass, v_pass, mask, kv_len, 4, 2, scale=scale, softcap=cap)
    from quickdraft.model.rope import apply_rope
    q = apply_rope(qkv.view(B, T, 8, D).transpose(1, 2)[:, :4], cos, sin)
    keys = ref_k[:, :, :kv_len].repeat_interleave(2, dim=1)
    scores = cap * torch.tanh(q @ keys.transpose(2, 3) * scale / cap)
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    ref = (probs @ ref_v[:, :, :kv_len].repeat_interleave(2, dim=1)).transpose(1, 2).reshape(B, T, 4 * D)
    assert torch.allclose(out, ref, atol=1e-5)
    uncapped = attend(qkv, cos, sin, positions, k_cache.clone(), v_cache.clone(), mask, kv_len, 4, 2,
                                      scale=scale)
    assert not torch.allclose(uncapped, ref, atol=1e-3)  # the premise: the cap changes the result
    t = T - 1
    alone = attend(qkv[:, t:], cos[:, :, t:], sin[:, :, t:], positions[:, t:], k_pass, v_pass, None,
                                   kv_len, 4, 2, scale=scale, softcap=cap)  # the last token, decoded after the others
    assert torch.equal(alone[:, 0], out[:, t])


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
def test_sinks_equal_transformers_eager_attention_and_stay_batch_invariant(D, ctx):
    """gpt-oss's sinks: a logit per query head joins each softmax as one more column, dropped after it
    (transformers' eager attention); a query's output alone equals its output among the others."""
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(D=D, ctx=ctx)
    _, ref_k, ref_v = torch_reference(qkv, cos, sin, positions, k_cache, v_cache)
    B, T, _ = qkv.shape
    kv_len = int(positions.max()) + 1
    mask = (torch.arange(kv_len) <= positions[..., None]).contiguous()
    sinks = torch.tensor([-1.0, 0.5, 2.0, 30.0])  # the last one takes nearly all the mass
    k_pass, v_pass = k_cache.clone(), v_cache.clone()
    out = attend(qkv, cos, sin, positions, k_pass, v_pass, mask, kv_len, 4, 2, sinks=sinks)
    from quickdraft.model.rope import apply_rope
    q = apply_rope(qkv.view(B, T, 8, D).transpose(1, 2)[:, :4], cos, sin)
    scores = q @ ref_k[:, :, :kv_len].repeat_interleave(2, dim=1).transpose(2, 3) * D ** -0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    combined = torch.cat((scores, sinks.view(1, 4, 1, 1).expand(B, 4, T, 1)), -1)
    probs = (combined - combined.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    ref = (probs @ ref_v[:, :, :kv_len].repeat_interleave(2, dim=1)).transpose(1, 2).reshape(B, T, 4 * D)
    assert torch.allclose(out, ref, atol=1e-5)
    without = attend(qkv, cos, sin, positions, k_cache.clone(), v_cache.clone(), mask, kv_len, 4, 2)
    assert not torch.allclose(without, ref, atol=1e-3)  # the premise: the sinks change the result
    t = T - 1
    alone = attend(qkv[:, t:], cos[:, :, t:], sin[:, :, t:], positions[:, t:], k_pass, v_pass, None, kv_len, 4, 2,
                   sinks=sinks)  # the last token, decoded after the others
    assert torch.equal(alone[:, 0], out[:, t])


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES)
@pytest.mark.parametrize("window", [3, 8, 13])
def test_a_windowed_query_equals_the_same_query_over_its_window_alone(D, ctx, window):
    """A sliding window hides the keys more than `window` positions back (the mask the model
    builds); the kernel skips whole blocks of them. Bitwise the same as attending, unmasked, over a
    cache holding only the window's keys: the visible keys are summed in the same order either way."""
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(B=1, T=1, ctx=ctx + 12, D=D)
    p = int(positions[0, 0])
    visible = (torch.arange(p + 1) > p - window)[None, None].contiguous()  # [1, 1, kv_len]
    masked = attend(qkv, cos, sin, positions, k_cache.clone(), v_cache.clone(), visible, p + 1, 4, 2)
    k_win, v_win = k_cache.clone(), v_cache.clone()
    k_win[:, :, :window - 1] = k_cache[:, :, p - window + 1:p]
    v_win[:, :, :window - 1] = v_cache[:, :, p - window + 1:p]
    alone = attend(qkv, cos, sin, torch.tensor([[window - 1]]), k_win, v_win, None, window, 4, 2)
    assert torch.equal(masked, alone)
    full = attend(qkv, cos, sin, positions, k_cache.clone(), v_cache.clone(), None, p + 1, 4, 2)
    assert not torch.allclose(full, masked)  # the premise: the window changes the result


@pytest.mark.parametrize("D, ctx", ATTENTION_SHAPES + [(64, 33), (128, 17)])
@pytest.mark.parametrize("case", ["decode", "pass", "tree", "window", "ragged"])
def test_keys_read_through_a_shuffled_block_table_give_the_same_bits(D, ctx, case):
    """Rows of 16-slot blocks at shuffled places in a pool (paged K/V): the K/V land in the row's
    blocks and every query's output is bitwise the one over the same keys laid out in one stretch,
    for a decode step, a causal pass, a tree's mask, a sliding window and a ragged pass of several
    rows; kv_len is rarely a multiple of 8 or 16 here."""
    T = 1 if case == "decode" else 5
    qkv, cos, sin, positions, k_cache, v_cache = attention_case(B=2, T=T, ctx=ctx, D=D)
    kv_len, rows = int(positions.max()) + 1, None
    visible = None
    if case == "tree":  # each node sees the context and the even nodes before it
        visible = torch.arange(kv_len) < ctx
        visible = (visible | ((torch.arange(kv_len) - ctx) % 2 == 0) & (torch.arange(kv_len) <= positions[..., None]))
        visible = visible.contiguous()
    if case == "window":
        visible = ((torch.arange(kv_len) > positions[..., None] - 6) & (torch.arange(kv_len) <= positions[..., None]))
    if case == "ragged":  # both rows' tokens as one sequence of a batch of 1
        rows = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0], dtype=torch.int64)
        positions = torch.tensor([[ctx, ctx, ctx + 1, ctx + 1, ctx + 2, ctx + 2, ctx + 3, ctx + 3, ctx + 4, ctx + 4]])
        qkv, cos, sin = qkv.reshape(1, 2 * T, -1), cos.transpose(0, 2).reshape(1, 1, 2 * T, D), \
            sin.transpose(0, 2).reshape(1, 1, 2 * T, D)
    if visible is not None:
        visible = visible.contiguous()
    tables, k_pool, v_pool, gather = paged(k_cache, v_cache)
    pages = kernels.Pages(tables, 16, k_pool.shape[0], kv_len)
    through_table = kernels.rope_attention(qkv, cos, sin, positions, pages, k_pool, v_pool, visible, kv_len, 4, 2,
                                           rows=rows)
    k_rows, v_rows = k_cache.clone(), v_cache.clone()
    in_rows = attend(qkv, cos, sin, positions, k_rows, v_rows, visible, kv_len, 4, 2, rows=rows)
    assert torch.equal(through_table, in_rows)
    assert torch.equal(gather(k_pool), k_rows) and torch.equal(gather(v_pool), v_rows)
    assert not torch.isnan(k_pool[1:]).any() and torch.isnan(k_pool[0]).all()  # block 0 neither read nor written


def test_block_tables_that_the_kernel_cannot_read_safely_are_refused():
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.Pages(tables, 16, 4, 20)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.Pages(tables, 16, 5, 33)
    with pytest.raises(ValueError, match="power of two"):
        kernels.Pages(tables, 12, 5, 20)
    pages = kernels.Pages(tables, 16, 5, 20)
    with pytest.raises(ValueError, match="not 5 float32 blocks of 16"):
        pages.bind(torch.zeros(5, 2, 8, 64), torch.zeros(5, 2, 8, 64))


def test_long_tasks_cover_every_row_on_any_thread_count():
    """A task runs through ~512 KB of weight rows (quant_matmul.c's TASK_BYTES) in blocks of 64:
    2,577 rows of 144 bytes make tasks of 5-10 blocks, the last one cut short. Every row is the
    reference's, and the same bits on 1 and 2 threads, for 1 row and for 12 + 1 (two groups)."""
    w = weight(Q.Q4_K, N=64 * 40 + 17, K=256, bits=8)
    W = w.dequantize().double()
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(10))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((kernels.linear(x, w), kernels.linear(x[:1], w)))
    finally:
        torch.set_num_threads(before)
    exact = quantized_rows(x, 8) @ W.T
    assert (results[0][0].double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    for many, one in results:
        assert torch.equal(many, results[0][0]) and torch.equal(one, many[:1])


def test_threads_share_the_work_without_changing_a_bit():
    """The pool (pool.c) splits rows and queries among threads; each is computed alone either way."""
    w, dense = weight(Q.Q5_K, N=200), torch.randn(200, 512, generator=torch.Generator().manual_seed(8))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(9))
    case = attention_case(B=3, T=9)
    kv_len = int(case[3].max()) + 1
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            k_cache, v_cache = case[4].clone(), case[5].clone()
            att = attend(case[0], case[1], case[2], case[3], k_cache, v_cache, None, kv_len, 4, 2)
            results.append((kernels.linear(x, w), kernels.linear(x, dense), att, k_cache))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_an_embedding_keeps_recent_rows_bitwise_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized embedding's lookups of a few tokens (a decode step's, a draft head's) come from
    the rows it keeps: the same bits as dequantizing them, at most ROW_CACHE_BYTES of them, none
    from a weight it no longer holds; a long lookup (a prompt's) dequantizes at once."""
    from quickdraft.model import llama
    embed = llama.Embedding(48, 64)
    del embed.weight  # as a model's loading holds blocks: a plain attribute, no Parameter (model/build.py)
    embed.weight = weight(Q.Q8_0, N=48, K=64)
    monkeypatch.setattr(llama, "ROW_CACHE_BYTES", 10 * 64 * 4)  # 10 rows
    for ids in ([[3]], [[3, 7, 3]], [[5], [9]], [list(range(40))]):
        tokens = torch.tensor(ids)
        assert torch.equal(embed(tokens), embed.weight.rows_of(tokens).view(*tokens.shape, -1))
    held, rows = embed._rows
    assert held is embed.weight and list(rows) == [7, 3, 5, 9]  # the long lookup kept none
    for t in range(20, 35):
        embed(torch.tensor([[t]]))
    assert list(embed._rows[1]) == list(range(25, 35))  # the 10 most recent
    embed.weight = weight(Q.Q8_0, N=48, K=64, seed=1)
    assert torch.equal(embed(torch.tensor([[30]]))[0], embed.weight.rows_of([30]))
