"""Tensor names: GGUF (llama.cpp) names -> Hugging Face names through a family's row
(model/families.py), and the tensors some checkpoints carry that hold nothing the model needs
(each with the reason).

The model is built from Hugging Face names and refuses a tensor it does not take; the GGUF loader
renames through the family's names and keeps a name outside them as it is, so that refusal names it.
An expert's matrices are one tensor per expert ("{e}") in a checkpoint and one stacked tensor of
every expert's in a GGUF: a GGUF name renames to its HF name with "{e}" left in, for the loader to
fill per expert. gpt-oss's checkpoints stack them too (transformers' layout): `unstack_experts`
gives them the per-expert names.
"""
from __future__ import annotations

import re
from typing import Any

from quickdraft.errors import ModelLoadError
from quickdraft.model.families import Family

# Hugging Face tensors that are dropped at load, and why. (GGUF's `rope_freqs.weight` is no such
# tensor: it divides the RoPE frequencies, weights/gguf_file.py.)
IGNORED_TENSORS: tuple[tuple[str, str], ...] = (
    ("model.layers.{i}.self_attn.rotary_emb.inv_freq",
     "RoPE inverse frequencies older transformers saved as buffers; computed from the config instead"),
    ("model.rotary_emb.inv_freq", "the same, saved once for the model"),
)


def name_pattern(template: str) -> re.Pattern[str]:
    """"{i}" (a layer) and "{e}" (an expert) match an index."""
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


_IGNORED = [name_pattern(hf) for hf, _ in IGNORED_TENSORS]


def ignored(name: str) -> bool:
    """Whether a Hugging Face tensor is one of IGNORED_TENSORS."""
    return any(pattern.match(name) for pattern in _IGNORED)


def hf_name_for_gguf(name: str, family: Family) -> str | None:
    """The Hugging Face name of a GGUF tensor in a file of `family`, or None for a name outside its table."""
    return _rename(name, family, 1)


def gguf_name_for_hf(name: str, family: Family) -> str | None:
    """The GGUF name llama.cpp's converter gives a Hugging Face tensor of `family` (None: not in its table)."""
    return _rename(name, family, 0)


def _rename(name: str, family: Family, source: int) -> str | None:
    """`name` matched against the family's names of one format (0: HF, 1: GGUF), in the other's."""
    for pair in family.names.values():
        m = name_pattern(pair[source]).match(name)
        if m:
            out = pair[1 - source]
            for index, value in m.groupdict().items():
                out = out.replace(f"{{{index}}}", value)
            return out
    return None


def unstack_experts(tensors: dict[str, Any], family: Family) -> dict[str, Any]:
    """A checkpoint's stacked expert tensors (Family.stacked_experts: x @ W, gate and up interleaved
    in gate|up's columns and its bias) as each expert's gate, up and down matrices ([out, in], as a
    Linear holds them) and biases under the family's per-expert names; the other tensors (MXFP4 experts
    already taken apart by weights/mxfp4.py among them) as they are.
    Takes the tensors out of `tensors` as it goes (a stacked one is freed once unstacked)."""
    if family.stacked_experts is None:
        return tensors
    stacked = [name_pattern(name) for name in family.stacked_experts]
    out = {}
    for name in list(tensors):
        t = tensors.pop(name)
        which = next((k for k, pattern in enumerate(stacked) if pattern.match(name)), None)
        if which is None:
            out[name] = t
            continue
        layer = stacked[which].match(name)["i"]
        if t.dim() != 3 - which % 2:
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}; expected {3 - which % 2} dimensions "
                                 f"(experts first)")
        pieces = {0: {"expert_gate": t[..., ::2], "expert_up": t[..., 1::2]},
                  1: {"expert_gate.bias": t[:, ::2], "expert_up.bias": t[:, 1::2]},
                  2: {"expert_down": t}, 3: {"expert_down.bias": t}}[which]
        for role, w in pieces.items():
            w = w.transpose(1, 2) if w.dim() == 3 else w  # [E, in, out] -> [E, out, in]
            out |= expert_tensors(family, role, layer, [w[e].contiguous() for e in range(w.shape[0])])
    return out


def expert_tensors(family: Family, role: str, layer: str, weights: list) -> dict:
    """Each expert's tensor of `role` in `layer` under the family's per-expert name, in expert order."""
    template = family.names[role][0].replace("{i}", layer)
    return {template.replace("{e}", str(e)): w for e, w in enumerate(weights)}
