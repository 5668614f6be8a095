"""ModelConfig: the shape and numerics of one decoder, its family's choices resolved.

Built from a Hugging Face `config.json` dict or from GGUF metadata (by weights/), validated here.
Architecture differences (biases, norm placement, QK-norm, windows per layer, tied embeddings,
rope scaling) are fields the family's row (families.py) and the checkpoint fill, not subclasses.
Every config key that changes the computation is read or refused by name
(UnsupportedArchitecture), never left to a default the checkpoint did not mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from quickdraft.errors import ModelLoadError, UnsupportedArchitecture
from quickdraft.model.families import GATES, HIDDEN_ACTS, Family, family

ROPE_KINDS = ("linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` (every frequency divided by `factor`: positions stretched),
    `llama3` (Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between
    blended) or `yarn` (YaRN: frequencies blended between interpolated and kept over a ramp of
    dimensions set by beta_fast / beta_slow, cos and sin times attention_factor), as transformers
    computes them; or `longrope` (Phi-3: each frequency divided by its `short_factor`, cos and sin
    times attention_factor; transformers switches a whole sequence to `long_factor` past the original
    context, which a KV cache cannot follow, so such a model runs within its original context); or
    `dynamic` (dynamic NTK: transformers keeps default RoPE up to max_position_embeddings and past it
    raises the base for each new sequence length, rotating every cached position anew, which a KV
    cache cannot follow either: such a model runs within max_position_embeddings, where it is
    default RoPE exactly)."""

    kind: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS or not self.factor > 0:
            raise ModelLoadError(f"rope scaling: expected kind {', '.join(map(repr, ROPE_KINDS))} and a positive "
                                 f"factor, found {self.kind!r}, {self.factor!r}")


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
    activation: str = "silu"  # the MLP gate's: "silu", "gelu_tanh" or "gelu" (erf), or gpt-oss's "swiglu_oai"
    norm: str = "pre"        # "pre": RMSNorm before each sublayer; "post": on its output (OLMo 2); "sandwich": both
    norm_offset: float = 0.0  # added to every norm's stored weight at load (Gemma's safetensors hold gain - 1)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    rope_local_theta: float | None = None  # the RoPE base of sliding-window layers, unscaled (Gemma 3); None: rope_theta
    attn_softcap: float | None = None   # attention scores become c tanh(s / c) (Gemma 2)
    logit_softcap: float | None = None  # and the logits likewise
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (per head), "proj" (whole projection)
    # the sliding window of each layer (None: the whole context); () for no window anywhere
    layer_windows: tuple[int | None, ...] = ()
    # a mixture of experts in place of every layer's MLP (0: a dense MLP of intermediate_size): each
    # token's output sums its experts_per_token experts (gated MLPs of expert_size), weighted by the
    # router's softmax, the top-k weights renormalized where norm_topk, multiplied in float32 where
    # expert_weights_float32 (Mixtral; else cast to the activations' dtype first)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk: bool = False
    expert_weights_float32: bool = False
    topk_first: bool = False      # the top k of the router's logits, then their softmax (gpt-oss)
    expert_biases: bool = False   # the router and every expert matrix have biases (gpt-oss)
    attn_sinks: bool = False      # a learned logit per query head joins each softmax's denominator (gpt-oss)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        family(self.model_type)
        if self.norm not in ("pre", "post", "sandwich") or self.qk_norm not in (None, "head", "proj") \
                or self.activation not in GATES:
            raise ModelLoadError(f"model config: norm {self.norm!r} / qk_norm {self.qk_norm!r} / activation "
                                 f"{self.activation!r}: expected 'pre', 'post' or 'sandwich' / None, 'head' or 'proj' / one "
                                 f"of {', '.join(GATES)}")
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
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.expert_size > 0):
            raise ModelLoadError(f"model config: {self.num_experts} experts need 1 to {self.num_experts} experts per "
                                 f"token and a positive expert size, found {self.experts_per_token} and "
                                 f"{self.expert_size}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or any(
                w is not None and (not isinstance(w, int) or w <= 0) for w in self.layer_windows)):
            raise ModelLoadError(f"model config: layer_windows must be a positive window or None for each of "
                                 f"the {self.num_layers} layers, found {self.layer_windows!r}")

    @property
    def family(self) -> Family:
        return family(self.model_type)

    def window(self, layer: int) -> int | None:
        """How many of the latest keys a query of `layer` sees (itself included); None: all."""
        return self.layer_windows[layer] if self.layer_windows else None

    def context_note(self, context: int) -> str:
        """Why a context of `context` tokens ends there, where its RoPE is what ends it ('' elsewhere):
        for the ContextTooLong message of a prompt that does not fit."""
        s = self.rope_scaling
        if context != self.max_position_embeddings or s is None or s.kind not in ("dynamic", "longrope"):
            return ""
        if s.kind == "dynamic":
            return (" (dynamic NTK RoPE: past max_position_embeddings transformers raises the RoPE base for each "
                    "new length, rotating every cached position anew, which a K/V cache cannot follow)")
        return (f" (LongRoPE: past its original context transformers rotates every position with the long factors, "
                f"which K/V cached with the short ones cannot follow; the checkpoint names "
                f"{round(s.factor * context)})")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict; keys that do not change the computation are ignored."""
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ModelLoadError("config.json has no 'model_type' key; expected e.g. 'llama' or 'qwen2'")
        spec = family(model_type)
        if "num_experts" in cfg:  # transformers' alias of num_local_experts (Qwen MoE checkpoints write it)
            cfg = {**cfg, "num_local_experts": cfg["num_experts"]}
        cfg = {**dict(spec.defaults), **cfg}  # an explicit null stays null (Mistral's window)
        rope, local_theta = _rope_of_layer_types(cfg) if spec.rope_per_layer_type else (_rope_parameters(cfg), None)
        _refuse_unsupported_hf(cfg, rope, spec)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            check_end_tokens(eos_ids, int(cfg["vocab_size"]), "config.json")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=_context(cfg, rope),
                rms_norm_eps=float(cfg["rms_norm_eps"]),
                rope_theta=float(rope["rope_theta"] if spec.rope_per_layer_type else
                                 rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling_from_hf(rope, cfg),
                rope_local_theta=local_theta,
                qkv_bias=_flag(cfg, spec.qkv_bias),
                o_bias=_flag(cfg, spec.o_bias),
                mlp_bias=_flag(cfg, spec.mlp_bias),
                activation=spec.gate or HIDDEN_ACTS[cfg.get(spec.activation_key, "silu")],
                norm=spec.norm,
                norm_offset=spec.hf_norm_offset,
                embed_scale=hidden ** 0.5 if spec.embed_scale else 1.0,
                attn_scale=float(cfg[spec.attn_scale_key]) ** -0.5 if spec.attn_scale_key else None,
                attn_softcap=_cap(cfg.get("attn_logit_softcapping")) if spec.softcaps else None,
                logit_softcap=_cap(cfg.get("final_logit_softcapping")) if spec.softcaps else None,
                qk_norm=spec.qk_norm,
                attn_sinks=spec.sinks,
                layer_windows=_layer_windows(cfg, spec),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **_experts(cfg, spec),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a malformed value: {e}") from None


def check_end_tokens(ids: tuple[Any, ...], vocab_size: int, where: str) -> None:
    """A file's eos_token_id values: token ids of the vocabulary (one past it failed later, inside the
    grammar's vocabulary, with a raw error)."""
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ModelLoadError(f"{where}: eos_token_id must be a token id or a list of them, found {i!r}")
        if i >= vocab_size:
            raise ModelLoadError(f"{where}: eos_token_id {i} is past the model's vocabulary (vocab_size {vocab_size})")


def _experts(cfg: dict[str, Any], spec: Family) -> dict[str, Any]:
    """A mixture of experts' settings as transformers' class of the family reads them; layers it
    would give a dense MLP (Qwen MoE's decoder_sparse_step, mlp_only_layers) are refused by name."""
    if not spec.moe:
        return {}
    count, step, dense = cfg["num_local_experts"], cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers")
    if spec.sparse_step_keys and (step != 1 or dense):
        raise UnsupportedArchitecture(
            f"decoder_sparse_step {step!r} / mlp_only_layers {dense!r} (dense MLP layers among the experts' "
            f"layers) is not supported; expected 1 / [] (experts in every layer)")
    if not isinstance(count, int) or count <= 0:
        raise UnsupportedArchitecture(f"num_experts {count!r} is not supported; expected a mixture of experts "
                                      f"(a positive count)")
    for key, value in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if spec.gate == "swiglu_oai" and cfg.get(key, value) != value:
            raise UnsupportedArchitecture(f"{key} {cfg[key]!r} is not supported; expected {value} (every gpt-oss "
                                          f"checkpoint's, which the kernels' clamped SwiGLU computes)")
    return dict(num_experts=count, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_size=int(cfg[spec.expert_size_key]), norm_topk=_flag(cfg, spec.norm_topk),
                expert_weights_float32=spec.expert_weights_float32, topk_first=spec.topk_first,
                expert_biases=spec.expert_biases)


def _cap(value: Any) -> float | None:
    """A soft-cap: None or 0 is none."""
    if value is not None and (not isinstance(value, (int, float)) or value < 0):
        raise ModelLoadError(f"config.json: a soft-cap must be a positive number or null, found {value!r}")
    return float(value) if value else None


def _flag(cfg: dict[str, Any], how: str | bool) -> bool:
    return how if isinstance(how, bool) else bool(cfg.get(how, False))


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings: transformers 5 reads the older `rope_scaling` first, then `rope_parameters`."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedArchitecture(
            f"rope parameters {rope!r} are not supported; expected one dict for every layer")
    return rope


def _rope_of_layer_types(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE: (the full-attention layers' parameters, the sliding layers' base), from
    transformers 5's `rope_parameters` per layer type, or the older rope_theta, rope_scaling
    (full layers only) and rope_local_base_freq."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedArchitecture(f"rope parameters for layer types {unknown} are not supported; expected "
                                          f"full_attention and sliding_attention")
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if _rope_scaling_from_hf(local) is not None or local.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedArchitecture(f"rope parameters {local!r} of sliding layers are not supported; expected "
                                          f"default RoPE there")
        return full, float(local.get("rope_theta", cfg["rope_local_base_freq"]))
    if params:
        raise UnsupportedArchitecture(f"rope parameters {params!r} are not supported; expected one dict per layer "
                                      f"type (full_attention, sliding_attention)")
    full = cfg.get("rope_scaling") or {}
    return {**full, "rope_theta": cfg["rope_theta"]}, float(cfg["rope_local_base_freq"])


def _refuse_unsupported_hf(cfg: dict[str, Any], rope: dict[str, Any], spec: Family) -> None:
    """Keys transformers' classes of the families read that ask for math this decoder does not do.
    (`pretraining_tp` only split the matmuls in older transformers, the same sums: accepted.)"""
    act = cfg.get(spec.activation_key, "silu")
    if act not in spec.activations:
        raise UnsupportedArchitecture(
            f"{spec.activation_key} {act!r} is not supported; expected one of {', '.join(spec.activations)}")
    for key, what in (("final_logit_softcapping", "soft-capped logits"), ("attn_logit_softcapping",
                      "soft-capped attention scores"), ("use_bidirectional_attention", "bidirectional attention")):
        if cfg.get(key) and not (spec.softcaps and "softcapping" in key):
            raise UnsupportedArchitecture(f"{key} {cfg[key]!r} ({what}) is not supported")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedArchitecture(
            f"partial_rotary_factor {partial!r} is not supported; expected 1.0 (RoPE over the whole head)")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method not in spec.stored_quantization:
            hint = (" (gpt-oss's MXFP4 checkpoints load as stored)" if method == "mxfp4" else "")
            raise UnsupportedArchitecture(
                f"quantization_config ({method!r}) is not supported for {spec.model_type}; expected float "
                f"safetensors weights (a GGUF file, or --quantize at load, runs quantized){hint}")
    heads = cfg.get("architectures") or []
    if isinstance(heads, list) and any(not str(a).endswith("ForCausalLM") for a in heads):
        raise UnsupportedArchitecture(
            f"architectures {heads!r} is not supported; expected a causal LM (e.g. 'LlamaForCausalLM')")


def _layer_windows(cfg: dict[str, Any], spec: Family) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' class of the family chooses it: a query sees
    the last `sliding_window` keys (itself included) of a sliding layer, every key of a full one."""
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if spec.window == "none" or window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer or null, found {window!r}")
    if spec.window == "all":
        return (window,) * layers
    if spec.window == "pattern" and not cfg.get("layer_types"):
        every = int(cfg["sliding_window_pattern"])
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]}
    if spec.window in ("flag", "layer_types") and not cfg.get("use_sliding_window"):
        return ()  # Qwen's window applies only with use_sliding_window
    if spec.window == "flag":
        return (window,) * layers
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg["max_window_layers"]) else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != layers or unknown:
        raise UnsupportedArchitecture(
            f"layer_types {types!r} is not supported; expected 'sliding_attention' or 'full_attention' for "
            f"each of the {layers} layers")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else ()


def _rope_scaling_from_hf(rope: dict[str, Any], cfg: dict[str, Any] | None = None) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("linear", "dynamic"):
        return RopeScaling(kind, float(rope["factor"]))
    if kind == "yarn":
        return _yarn(rope, cfg or {})
    if kind == "longrope":
        return _longrope(rope, cfg or {})
    if kind != "llama3":
        raise UnsupportedArchitecture(
            f"rope scaling type {kind!r} is not supported; expected 'default' or one of {', '.join(map(repr, ROPE_KINDS))}")
    return RopeScaling(
        "llama3",
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _yarn(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """YaRN's settings as transformers resolves them: the factor (else the context's ratio to the
    original), the attention factor (else 0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""
    original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = float(rope.get("factor") or int(cfg["max_position_embeddings"]) / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=float(attention), truncate=bool(rope.get("truncate", True)))


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin scale where the config gives none, as transformers computes it: 0.1 ln(factor)
    + 1, or (DeepSeek) the ratio of two such with mscale and mscale_all_dim as multipliers."""
    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return scale(mscale) / scale(mscale_all_dim) if mscale and mscale_all_dim else scale(1.0)


def _longrope(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """LongRoPE as transformers resolves it for sequences within the original context: the short
    factors, and the attention factor (else sqrt(1 + ln(factor) / ln(original)), factor the
    context's ratio to the original)."""
    original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = float(rope.get("factor") or int(cfg["max_position_embeddings"]) / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = tuple(float(f) for f in rope["short_factor"])
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), short_factor=short)


def _context(cfg: dict[str, Any], rope: dict[str, Any]) -> int:
    """The context a model runs in: its own, or a LongRoPE model's original one (past it transformers
    rotates every position with other factors, so K/V cached before would no longer match)."""
    context = int(cfg.get("max_position_embeddings", 2048))
    if (rope.get("rope_type") or rope.get("type")) == "longrope":
        return min(context, int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]))
    return context
