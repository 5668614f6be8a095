"""A mixture of experts over GGUF-block weights in one C call a layer (experts.c): the experts a pass
chose, each over the rows that chose it, summed per row in ascending expert index. This module packs
the experts' weights for C once (`ExpertTable`) and makes the call (`run_experts`); the routing and
the math are model/experts.py's.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from quickdraft.kernels.build import active_library
from quickdraft.kernels.layer import GATES
from quickdraft.kernels.quantized import QuantizedWeight


class _Matrix(ctypes.Structure):
    _fields_ = [("first", ctypes.c_void_p), ("types", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("data", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


def _matrix(weights: list[QuantizedWeight], biases: list[torch.Tensor | None], keep: list) -> _Matrix:
    """One matrix of every expert, its parts flattened (expert e's: first[e] .. first[e + 1] - 1), and
    their biases (every expert's, or none)."""
    parts = [p for w in weights for p in w.parts]
    first = [0]
    for w in weights:
        first.append(first[-1] + len(w.parts))
    arrays = ((ctypes.c_int * len(first))(*first), (ctypes.c_int * len(parts))(*(int(p.qtype) for p in parts)),
              (ctypes.c_int64 * len(parts))(*(p.rows for p in parts)),
              (ctypes.c_void_p * len(parts))(*(p.packed.ctypes.data for p in parts)))
    keep.extend(arrays)
    keep.extend(parts)  # the blocks the pointers point into
    bias = None
    if biases[0] is not None:
        floats = [b.float().contiguous() for b in biases]
        bias = (ctypes.c_void_p * len(floats))(*(b.data_ptr() for b in floats))
        keep.extend((*floats, bias))
    return _Matrix(*(ctypes.addressof(a) for a in arrays), None if bias is None else ctypes.addressof(bias))


@dataclass
class ExpertTable:
    """Every expert's gate|up [2F, K] and down [K, F] (and their biases, where the family has them)
    as experts.c reads them; holds what its pointers point into."""
    gate_up: _Matrix
    down: _Matrix
    experts: int
    hidden: int
    size: int
    act8: int
    keep: list

    @staticmethod
    def of(experts: list[tuple[QuantizedWeight | torch.Tensor, QuantizedWeight | torch.Tensor]],
           biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None) -> "ExpertTable | None":
        """(gate|up, down) of each expert, in expert order, and their biases (None: none); None unless
        every matrix is GGUF blocks the kernel repacked, all with activations of one precision."""
        biases = biases or [(None, None)] * len(experts)
        matrices = [w for pair in experts for w in pair]
        if not all(isinstance(w, QuantizedWeight) and all(p.packed is not None for p in w.parts) for w in matrices) \
                or len({w.activation_bits for w in matrices}) != 1:
            return None
        keep: list = []
        gate_up = _matrix([g for g, _ in experts], [b for b, _ in biases], keep)
        down = _matrix([d for _, d in experts], [b for _, b in biases], keep)
        hidden, size = experts[0][1].shape
        return ExpertTable(gate_up, down, len(experts), hidden, size, experts[0][0].c_parts[4], keep)


def experts_usable(x: torch.Tensor) -> bool:
    """Whether experts.c can take x: float32 on the CPU outside autograd, the kernels built."""
    return active_library() is not None and x.device.type == "cpu" and x.dtype == torch.float32 and \
        not (torch.is_grad_enabled() and x.requires_grad)


def run_experts(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None, chosen: torch.Tensor,
                weights: torch.Tensor, table: ExpertTable, gate: str) -> torch.Tensor:
    """x [M, K]; norm: the RMSNorm (gain, eps) before each gate|up (None: none); chosen [M, k] int64
    and weights [M, k] float32 each row's experts -> [M, K] the weighted sums."""
    x = x.contiguous()
    chosen = chosen.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    gain = None if norm is None else norm[0].float().contiguous()
    out = torch.empty_like(x)
    M, K = x.shape
    status = active_library().qd_experts(
        x.data_ptr(), None if gain is None else gain.data_ptr(), 0.0 if norm is None else norm[1], M, K, table.size,
        chosen.shape[1], chosen.data_ptr(), weights.data_ptr(), table.experts, ctypes.byref(table.gate_up),
        ctypes.byref(table.down), table.act8, GATES[gate], out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise ValueError(f"an expert index outside 0..{table.experts - 1}")
    if status != 0:
        raise MemoryError(f"the experts of {M} rows could not allocate their buffers")
    return out
