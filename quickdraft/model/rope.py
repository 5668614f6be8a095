"""Rotary position embeddings: inverse frequencies (linear, dynamic NTK, llama3, YaRN or LongRoPE scaling) and their
application.

Uses the Hugging Face "rotate half" layout; the GGUF loader un-permutes llama.cpp's interleaved
q/k weights into it, so one rotation serves every checkpoint.
"""
from __future__ import annotations

import math

import torch

from quickdraft.errors import ModelLoadError
from quickdraft.model.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None,
                        local: bool = False) -> torch.Tensor:
    """[head_dim/2] float32. `freq_factors` are GGUF's `rope_freqs` divisors, when a file has them.
    `local`: those of sliding layers with a base of their own (rope_local_theta), never scaled."""
    dim = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    # on the CPU whatever device is the default: a model built on "meta" computed these through
    # torch's reference decompositions, whose first use imported for ~1.5 s of a load
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if local:
        return inv_freq
    scaling = config.rope_scaling
    if freq_factors is not None:  # llama.cpp applies a linear factor on top
        inv_freq = inv_freq / freq_factors.float()
    if scaling is None or scaling.kind == "dynamic" or freq_factors is not None and scaling.kind != "linear":
        return inv_freq  # dynamic NTK within max_position_embeddings, the only context it runs in: default
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(theta, dim, scaling)
    if scaling.kind == "longrope":  # as transformers: 1 / (factor_i * base ** (2i / dim))
        if len(scaling.short_factor) != dim // 2:
            raise ModelLoadError(f"rope scaling: LongRoPE needs {dim // 2} short factors, found {len(scaling.short_factor)}")
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32, device="cpu") * theta ** shape)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn(base: float, dim: int, s: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies, as transformers computes them: interpolated (divided by the factor) for
    dimensions that turn fewer than beta_slow times over the original context, kept for those that
    turn more than beta_fast times, a linear ramp between."""
    def correction(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(s.beta_fast), correction(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    return 1.0 / (s.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


class RotaryTable:
    """cos and sin of position x inverse frequency for positions [0, n), looked up per forward and
    grown (doubling) when a longer context arrives.

    Why a table: torch runs cos/sin of even 128 values on its OpenMP threads, whose workers then
    spin on the core the C kernels' own pool needs; on 2 cores that made a SmolLM2 pass over 2
    tokens 17 ms instead of 11. A lookup is an index, no transcendental, no thread pool."""

    def __init__(self, scale: float = 1.0) -> None:
        self.cos: torch.Tensor | None = None  # [n, head_dim] float32
        self.sin: torch.Tensor | None = None
        self.scale = scale  # cos and sin times it (YaRN's attention factor), as transformers'

    @staticmethod
    def of(config: ModelConfig) -> "RotaryTable":
        """The table of a model's (full-attention) layers."""
        scaling = config.rope_scaling
        return RotaryTable(scaling.attention_factor if scaling is not None and scaling.kind in ("yarn", "longrope")
                           else 1.0)

    def __call__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [B, 1, T, head_dim] for positions [B, T] (of the same values as computing
        them in float32 per forward), cast to dtype."""
        need = int(positions.max()) + 1
        if self.cos is None or self.cos.shape[0] < need or self.cos.device != inv_freq.device:
            n = max(need, 256, 2 * (0 if self.cos is None else self.cos.shape[0]))
            freqs = torch.arange(n, device=inv_freq.device).unsqueeze(-1).float() * inv_freq  # [n, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
            if self.scale != 1.0:
                self.cos, self.sin = self.cos * self.scale, self.sin * self.scale
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
