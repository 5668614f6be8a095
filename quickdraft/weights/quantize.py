"""`--quantize int8|int4`: weight-only, group-wise quantization of float matrices at load.

Each row is quantized in groups of 32 values into a GGUF block type the kernel runs as stored:
int8 -> Q8_0 (one scale per group), int4 -> Q4_1 (a scale and a minimum per group), using gguf's
own quantizers, so a quantized Hugging Face model is the model llama.cpp's converter would write.
Norms, biases and the embedding table stay as they are (the table is read a row at a time).
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from tqdm import tqdm

from quickdraft.errors import ModelLoadError
from quickdraft.kernels.quantized import Part, QuantizedWeight

SCHEMES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}
GROUP = 32
# attention and MLP projections (experts' too: Mixtral names them w1, w2, w3), the output head; never
# a router (mlp.gate), whose choice of experts stays that of the float weights
MATRICES = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight", "lm_head.weight")


def quantize_tensors(tensors: dict[str, torch.Tensor | QuantizedWeight], scheme: str,
                     progress: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The same tensors with every float matrix quantized by `scheme` (already quantized ones kept)."""
    if scheme not in SCHEMES:
        raise ModelLoadError(f"--quantize must be one of {', '.join(SCHEMES)}, found {scheme!r}")
    qtype = SCHEMES[scheme]
    out = dict(tensors)
    names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and n.endswith(MATRICES)]
    for name in tqdm(names, desc=f"quantizing to {scheme}", unit="matrix", disable=not progress, leave=False):
        w = tensors[name]
        if w.ndim != 2 or w.shape[1] % GROUP:
            raise ModelLoadError(f"cannot quantize {name} of shape {tuple(w.shape)}: rows must be whole "
                                 f"groups of {GROUP} values")
        out[name] = as_blocks(w, qtype)
    return out


def as_blocks(weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """A float matrix [N, K] (K whole groups of 32) as GGUF blocks of `qtype`, by gguf's quantizer."""
    blocks = quantize(weight.detach().float().contiguous().cpu().numpy(), qtype)
    return QuantizedWeight([Part(qtype, blocks)], weight.shape[1])
