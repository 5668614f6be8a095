"""A decoder layer over GGUF-block weights in one C call (layer.c): what a decode step spends in
Python drops from ~150 kernel calls to 30. The layer's recipe is model/llama.py's Block; this
module only packs its weights for C, once.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from quickdraft.kernels.build import active_library
from quickdraft.kernels.pages import Pages
from quickdraft.kernels.quantized import QuantizedWeight

GATES = {"silu": 2, "gelu_tanh": 3, "gelu": 4, "swiglu_oai": 5}  # kernels.h's gated prologues


class _Linear(ctypes.Structure):
    _fields_ = [("nparts", ctypes.c_int), ("types", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("data", ctypes.c_void_p), ("act8", ctypes.c_int), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("bias", ctypes.c_void_p)]


NORMS = ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "q_norm", "k_norm")


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("wo", _Linear), ("gate_up", _Linear), ("down", _Linear),
                *((name, ctypes.c_void_p) for name in NORMS), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("n_q", ctypes.c_int64), ("n_kv", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("q_norm_len", ctypes.c_int64), ("k_norm_len", ctypes.c_int64),
                ("glu", ctypes.c_int64), ("softcap", ctypes.c_float), ("sinks", ctypes.c_void_p)]


@dataclass
class FusedLayer:
    """A layer's weights as layer.c reads them; holds every tensor its pointers point into."""
    layer: _Layer
    keep: tuple

    @staticmethod
    def of(linears: list[tuple[QuantizedWeight, torch.Tensor | None]], norms: dict[str, torch.Tensor | None],
           eps: float, n_q: int, n_kv: int, head_dim: int, gate: str = "silu",
           scale: float | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> "FusedLayer":
        """`linears`: (weight, bias or None) of q|k|v, o, gate|up and down, in that order (q|k|v and o
        alone: the attention half, for a layer whose MLP is a mixture of experts); `norms`:
        the gains of NORMS a family has (None for the others). A QK-norm gain spans a head or the
        whole projection, as long as it is. `gate`: the MLP gate's activation (kernels.GATES); `scale`:
        the attention scores' (None: head_dim ** -0.5); `softcap`: theirs (None: none); `sinks`: [n_q]
        attention sinks (None: none)."""
        gains = {name: None if norms.get(name) is None else norms[name].float().contiguous() for name in NORMS}
        keep = [g for g in gains.values() if g is not None]
        if sinks is not None:
            if sinks.numel() != n_q:  # layer.c reads one per query head
                raise ValueError(f"{sinks.numel()} attention sinks for {n_q} query heads")
            sinks = sinks.float().contiguous()
            keep.append(sinks)

        def linear(w: QuantizedWeight, b: torch.Tensor | None) -> _Linear:
            n, types, rows, data, act8 = w.c_parts
            if b is not None:
                b = b.float().contiguous()
                keep.append(b)
            return _Linear(n, ctypes.addressof(types), ctypes.addressof(rows), ctypes.addressof(data), act8, w.shape[0],
                           w.shape[1], None if b is None else b.data_ptr())

        qkv, wo, gate_up, down = (*(linear(w, b) for w, b in linears), *(_Linear() for _ in range(4 - len(linears))))
        qk_len = [0 if gains[n] is None else gains[n].shape[0] for n in ("q_norm", "k_norm")]
        layer = _Layer(qkv, wo, gate_up, down, *(None if g is None else g.data_ptr() for g in gains.values()), eps,
                       head_dim ** -0.5 if scale is None else scale, n_q, n_kv, head_dim, *qk_len, GATES[gate],
                       softcap or 0.0, None if sinks is None else sinks.data_ptr())
        return FusedLayer(layer, tuple(keep))


def fused_layer_usable(x: torch.Tensor, cache_dtype: torch.dtype, *weights: object) -> bool:
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return (x.device.type == "cpu" and x.dtype == torch.float32 and cache_dtype == torch.float32
            and all(isinstance(w, QuantizedWeight) for w in weights) and active_library() is not None)


def run_layer(x: torch.Tensor, fused: FusedLayer, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              pages: Pages, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, kv_len: int,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, hidden] -> the layer's output (a new tensor); K/V written to the cache (pages: its
    block tables, k, v [blocks, n_kv, block, head_dim] this layer's pools) at `positions` [B, T]
    (int64); cos, sin [B, 1, T, head_dim]; visible [B, T, kv_len] or None (causal: each token sees its
    row's keys at slots 0..its own); rows [B * T] int64: each token's cache row (a ragged pass,
    B = 1), None: its batch row."""
    B, T, _ = x.shape
    address = pages.bind(k, v)
    out = x.contiguous().clone()
    status = active_library().qd_layer(
        out.data_ptr(), ctypes.addressof(fused.layer), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
        positions.data_ptr(), None if rows is None else rows.data_ptr(), address,
        None if visible is None else visible.data_ptr(), B, T, kv_len, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"a layer over {B * T} rows could not allocate its buffers")
    return out
