"""ModelConfig: the shape and numerics of a Llama-family transformer.

Built from a Hugging Face `config.json` dict or from GGUF metadata (by weights/), validated here.
Architecture differences (biases, tied embeddings, rope scaling) are fields, not subclasses. Every
config key that changes the computation is read or refused by name (UnsupportedArchitecture),
never left to a default the checkpoint did not mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import ModelLoadError, UnsupportedArchitecture

# HF `model_type` values whose math is the Llama block with the flags below.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# transformers' names for x * sigmoid(x), the activation of the SwiGLU our kernels fuse.
ACTIVATIONS = ("silu", "swish")

# Which projections carry a bias, per family, as transformers builds them: a config key (read,
# default false) or a constant (transformers' Mistral and Qwen2 read no bias key at all).
FAMILY_BIASES: dict[str, dict[str, str | bool]] = {
    "llama": {"qkv": "attention_bias", "o": "attention_bias", "mlp": "mlp_bias"},
    "mistral": {"qkv": False, "o": False, "mlp": False},
    "qwen2": {"qkv": True, "o": False, "mlp": False},
}

# What transformers' config classes assume for keys a config.json may leave out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6},
    "mistral": {"rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": 4096},
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False   # q, k and v projections
    o_bias: bool = False     # the attention output projection
    mlp_bias: bool = False   # gate, up and down projections
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type {self.model_type!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"model config: {name} must be a positive integer, found {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for RoPE, found {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict; keys that do not change the computation are ignored."""
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ModelLoadError("config.json has no 'model_type' key; expected e.g. 'llama' or 'qwen2'")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type {model_type!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        cfg = {**FAMILY_DEFAULTS[model_type], **cfg}  # an explicit null stays null (Mistral's window)
        rope = _rope_parameters(cfg)
        _refuse_unsupported_hf(cfg, rope)
        biases = {part: _flag(cfg, how) for part, how in FAMILY_BIASES[model_type].items()}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=_context_length(cfg),
                rms_norm_eps=float(cfg["rms_norm_eps"]),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling_from_hf(rope),
                qkv_bias=biases["qkv"],
                o_bias=biases["o"],
                mlp_bias=biases["mlp"],
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a malformed value: {e}") from None


def _flag(cfg: dict[str, Any], how: str | bool) -> bool:
    return how if isinstance(how, bool) else bool(cfg.get(how, False))


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings: transformers 5 reads the older `rope_scaling` first, then `rope_parameters`."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedArchitecture(
            f"rope parameters {rope!r} are not supported; expected one dict for every layer")
    return rope


def _refuse_unsupported_hf(cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """Keys transformers' Llama, Mistral and Qwen2 read that ask for math this decoder does not do.
    (`pretraining_tp` only split the matmuls in older transformers, the same sums: accepted.)"""
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedArchitecture(
            f"hidden_act {act!r} is not supported; expected 'silu' (the SwiGLU MLP quickdraft's kernels fuse)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedArchitecture(
            f"partial_rotary_factor {partial!r} is not supported; expected 1.0 (RoPE over the whole head)")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedArchitecture(
            f"quantization_config ({method!r}) is not supported; expected float safetensors weights "
            f"(a GGUF file, or --quantize at load, runs quantized)")
    heads = cfg.get("architectures") or []
    if isinstance(heads, list) and any(not str(a).endswith("ForCausalLM") for a in heads):
        raise UnsupportedArchitecture(
            f"architectures {heads!r} is not supported; expected a causal LM (e.g. 'LlamaForCausalLM')")


def _context_length(cfg: dict[str, Any]) -> int:
    context = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True):
        # We attend to the whole context; within one window that equals sliding-window attention,
        # so the usable context is capped there rather than computed inexactly beyond it.
        context = min(context, window)
    return context


def _rope_scaling_from_hf(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedArchitecture(
            f"rope scaling type {kind!r} is not supported; expected 'default' or 'llama3'")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
