"""Building a Transformer from a checkpoint's tensors under its family's Hugging Face names.

q|k|v and gate|up (each expert's too) become one matrix each (as the checkpoint holds them, or
concatenated; GGUF blocks stay blocks when every piece is), every tensor is taken by its role in
the family's row (families.py) or refused by name: a tensor the model never took is math it would
skip.
Knows no file formats (weights/ reads them) and nothing of generation.
"""
from __future__ import annotations

import torch

from quickdraft import kernels
from quickdraft.errors import ModelLoadError, UnsupportedArchitecture
from quickdraft.kernels import QuantizedWeight
from quickdraft.model.config import ModelConfig
from quickdraft.model.llama import Transformer
from quickdraft.model.rope import inverse_frequencies


def build_transformer(config: ModelConfig, tensors: dict[str, torch.Tensor | QuantizedWeight],
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                      rope_freq_factors: torch.Tensor | None = None) -> Transformer:
    """A Transformer from tensors under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`...).
    `QuantizedWeight` matrices stay as stored on CPU and are dequantized to `dtype` elsewhere."""
    kernels.prepare()  # build the CPU kernels now, never inside a forward
    with torch.device("meta"):
        model = Transformer(config, None)
    fused = _fuse(config, _Taker(tensors))
    expected = {name: p.shape for name, p in model.state_dict().items()}
    for name, shape in expected.items():
        if fused[name].shape != shape:
            raise ModelLoadError(f"tensor for {name} has shape {tuple(fused[name].shape)}, "
                                 f"the config implies {tuple(shape)}")
    on_cpu = torch.device(device).type == "cpu"
    norm_dtype = torch.float32 if on_cpu else dtype  # = compute_dtype
    stored = {k: v for k, v in fused.items() if isinstance(v, QuantizedWeight) and on_cpu}
    # norms' gains and sinks in the activations' dtype (transformers keeps gpt-oss's sinks as stored,
    # adding them to float32 scores)
    model.load_state_dict({k: _norm_gain(_dense(v), config.norm_offset).to(device=device, dtype=norm_dtype)
                           if "norm" in k else _dense(v).to(device=device, dtype=norm_dtype)
                           if k.endswith("sinks") else _dense(v).to(device=device, dtype=dtype)
                           for k, v in fused.items() if k not in stored}, assign=True, strict=False)
    for name, weight in stored.items():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        del owner.weight  # a plain attribute now: the blocks are no Parameter
        owner.weight = weight
    if config.tie_word_embeddings:
        if isinstance(model.embed.weight, QuantizedWeight):
            del model.lm_head.weight
        model.lm_head.weight = model.embed.weight
    model.inv_freq = inverse_frequencies(config, rope_freq_factors).to(device)
    if config.rope_local_theta is not None:
        model.inv_freq_local = inverse_frequencies(config, local=True).to(device)
    return model.requires_grad_(False).eval()


def _norm_gain(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """A norm's gain from its stored weight: Gemma's safetensors store gain - 1 (transformers
    computes 1 + w in float32, as here); as stored when the offset is 0."""
    return weight if offset == 0.0 else weight.float() + offset


def _dense(w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def _cat(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Rows of q|k|v or gate|up in one matrix: as stored if every piece is, else float."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)
    return torch.cat([_dense(p) for p in parts])


class _Taker:
    """Hands out a checkpoint's tensors by name and keeps the names it handed out: a tensor the
    model never took is math it would skip, so what is left over is refused."""

    def __init__(self, tensors: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        self.tensors = tensors
        self.taken: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor | QuantizedWeight:
        if name not in self.tensors:
            raise ModelLoadError(f"weights are missing tensor {name!r}")
        self.taken.add(name)
        return self.tensors[name]

    def optional(self, name: str) -> torch.Tensor | QuantizedWeight | None:
        return self(name) if name in self.tensors else None

    def refuse_left_over(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            shown = ", ".join(repr(n) for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise UnsupportedArchitecture(
                f"the checkpoint has {len(left)} tensor(s) this model does not use: {shown}; "
                f"running without them would not be the checkpoint's model")


def _fuse(config: ModelConfig, take: _Taker) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The Transformer's state dict from the checkpoint's tensors: every one taken, or refused."""
    names = {role: hf for role, (hf, _) in config.family.names.items()}
    embed = take(names["embed"])
    fused = {"embed.weight": embed, "norm.weight": take(names["norm"])}
    head = take.optional(names["lm_head"])
    if config.tie_word_embeddings:
        if head is not None and not _same(head, embed):
            raise ModelLoadError(f"{names['lm_head']!r} differs from {names['embed']!r}, which the config "
                                 f"ties it to (tie_word_embeddings)")
        head = embed
    elif head is None:
        raise ModelLoadError(f"weights have no {names['lm_head']!r} but the config says embeddings are not tied")
    fused["lm_head.weight"] = head
    for i in range(config.num_layers):
        layer = {role: hf.replace("{i}", str(i)) for role, hf in names.items() if "{i}" in hf}
        fused |= _fuse_layer(config, take, layer, f"blocks.{i}.")
    take.refuse_left_over()
    return fused


def _fuse_layer(config: ModelConfig, take: _Taker, n: dict[str, str], ours: str
                ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """One layer (n: role -> its tensor's name): q|k|v and gate|up as one matrix each (as the
    checkpoint has them, or concatenated), their biases likewise where the family has them; or
    the router and each expert's gate|up and down."""
    out = {f"{ours}wqkv.weight": take(n["qkv"]) if "qkv" in n else _cat([take(n[p]) for p in "qkv"]),
           f"{ours}wo.weight": take(n["o"])}
    if config.num_experts:
        out[f"{ours}moe.router.weight"] = take(n["router"])
        biases = ("expert_gate.bias", "expert_up.bias", "expert_down.bias") if config.expert_biases else ()
        if config.expert_biases:
            out[f"{ours}moe.router.bias"] = _dense(take(n["router.bias"]))
        for e in range(config.num_experts):
            name = {role: n[role].replace("{e}", str(e)) for role in ("expert_gate", "expert_up", "expert_down") + biases}
            mine = f"{ours}moe.experts.{e}."
            out[f"{mine}w_gate_up.weight"] = _cat([take(name["expert_gate"]), take(name["expert_up"])])
            out[f"{mine}w_down.weight"] = take(name["expert_down"])
            if biases:
                out[f"{mine}w_gate_up.bias"] = torch.cat([_dense(take(name[r])) for r in biases[:2]])
                out[f"{mine}w_down.bias"] = _dense(take(name["expert_down.bias"]))
    else:
        out[f"{ours}w_gate_up.weight"] = take(n["gate_up"]) if "gate_up" in n else _cat([take(n["gate"]),
                                                                                        take(n["up"])])
        out[f"{ours}w_down.weight"] = take(n["down"])
    for role in ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "q_norm", "k_norm"):
        if role in n:
            out[f"{ours}{role}.weight"] = take(n[role])
    if config.attn_sinks:
        out[f"{ours}sinks"] = _dense(take(n["sinks"]))
    if config.qkv_bias:
        out[f"{ours}wqkv.bias"] = torch.cat([_dense(take(n[f"{p}.bias"])) for p in "qkv"])
    if config.o_bias:
        out[f"{ours}wo.bias"] = _dense(take(n["o.bias"]))
    if config.mlp_bias:
        out[f"{ours}w_gate_up.bias"] = torch.cat([_dense(take(n[f"{p}.bias"])) for p in ("gate", "up")])
        out[f"{ours}w_down.bias"] = _dense(take(n["down.bias"]))
    return out


def _same(a: torch.Tensor | QuantizedWeight, b: torch.Tensor | QuantizedWeight) -> bool:
    """Whether a checkpoint's LM head is its embedding table again (tied checkpoints may carry both)."""
    if a is b:
        return True
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.equal(a, b.to(a.dtype)))
