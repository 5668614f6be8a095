"""Decoder families as data: one row per family, read by the loaders (config.py, weights/) and
followed by the one Block (model/llama.py).

A row says how a checkpoint of the family is read (HF `model_type`, GGUF architecture, tensor
names, the defaults transformers' config class assumes, which config keys turn biases on, how
the sliding window is chosen per layer) and what math it asks for (norm placement, QK-norm,
activation, a mixture of experts and its routing). Adding a family is a row here plus tests. Knows
nothing of torch, files or kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Mapping

from quickdraft.errors import UnsupportedArchitecture

# role -> (Hugging Face name, GGUF name); "{i}" is the layer index. The roles are the model's
# parts (model/llama.py takes each by role); a family's row says which of them its files hold.
TensorNames = tuple[tuple[str, str, str], ...]

_LLAMA_TENSORS: TensorNames = (
    ("embed", "model.embed_tokens.weight", "token_embd.weight"),
    ("norm", "model.norm.weight", "output_norm.weight"),
    ("lm_head", "lm_head.weight", "output.weight"),
    ("attn_norm", "model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("q", "model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("k", "model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("v", "model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("q.bias", "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    ("k.bias", "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    ("v.bias", "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    ("o", "model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("o.bias", "model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    ("mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("gate", "model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("up", "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("down", "model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    ("gate.bias", "model.layers.{i}.mlp.gate_proj.bias", "blk.{i}.ffn_gate.bias"),
    ("up.bias", "model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias"),
    ("down.bias", "model.layers.{i}.mlp.down_proj.bias", "blk.{i}.ffn_down.bias"),
)
_QK_NORMS: TensorNames = (
    ("q_norm", "model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("k_norm", "model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)
# OLMo 2's `post_attention_layernorm` is the attention's post-norm (Llama's is the MLP's pre-norm)
_POST_NORMS: TensorNames = (
    ("attn_post_norm", "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    ("mlp_post_norm", "model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
)
# Gemma 2 and 3 normalize each sublayer's input and its output ("sandwich"): the MLP's pre-norm has its own name
_GEMMA_TENSORS: TensorNames = tuple(
    ("mlp_norm", "model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight") if role == "mlp_norm"
    else (role, hf, gguf) for role, hf, gguf in _LLAMA_TENSORS) + _POST_NORMS
# Phi-3's checkpoints hold q|k|v and gate|up as one matrix each (the model's own layout); GGUF
# keeps gate|up under ffn_up
_FUSED: TensorNames = (
    ("qkv", "model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight"),
    ("gate_up", "model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight"),
)
# A mixture of experts in place of the MLP: the router, and each expert's gated MLP, one matrix per
# expert ("{e}") in a checkpoint, every expert's in one stacked tensor ([E, rows, cols]) in a GGUF
_DENSE_MLP = ("gate", "up", "down", "gate.bias", "up.bias", "down.bias")
_QWEN_EXPERTS: TensorNames = (
    ("router", "model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight"),
    ("expert_gate", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight"),
    ("expert_up", "model.layers.{i}.mlp.experts.{e}.up_proj.weight", "blk.{i}.ffn_up_exps.weight"),
    ("expert_down", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "blk.{i}.ffn_down_exps.weight"),
)
# gpt-oss: a biased router and biased experts (a GGUF holds gate and up apart, as here; its
# checkpoints hold every expert in one tensor: `stacked_experts`), a sink logit per query head, and
# the MLP's pre-norm under another GGUF name
_GPT_OSS_TENSORS: TensorNames = (
    ("router", "model.layers.{i}.mlp.router.weight", "blk.{i}.ffn_gate_inp.weight"),
    ("router.bias", "model.layers.{i}.mlp.router.bias", "blk.{i}.ffn_gate_inp.bias"),
    ("expert_gate", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight"),
    ("expert_up", "model.layers.{i}.mlp.experts.{e}.up_proj.weight", "blk.{i}.ffn_up_exps.weight"),
    ("expert_down", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "blk.{i}.ffn_down_exps.weight"),
    ("expert_gate.bias", "model.layers.{i}.mlp.experts.{e}.gate_proj.bias", "blk.{i}.ffn_gate_exps.bias"),
    ("expert_up.bias", "model.layers.{i}.mlp.experts.{e}.up_proj.bias", "blk.{i}.ffn_up_exps.bias"),
    ("expert_down.bias", "model.layers.{i}.mlp.experts.{e}.down_proj.bias", "blk.{i}.ffn_down_exps.bias"),
    ("sinks", "model.layers.{i}.self_attn.sinks", "blk.{i}.attn_sinks.weight"),
    ("mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
)
# transformers' GptOssExperts: x @ W, gate|up [E, hidden, 2F] with gate and up interleaved, its
# bias [E, 2F] likewise, down [E, F, hidden], its bias [E, hidden]
_GPT_OSS_STACKED = ("model.layers.{i}.mlp.experts.gate_up_proj", "model.layers.{i}.mlp.experts.gate_up_proj_bias",
                    "model.layers.{i}.mlp.experts.down_proj", "model.layers.{i}.mlp.experts.down_proj_bias")
_MIXTRAL_EXPERTS: TensorNames = (
    ("router", "model.layers.{i}.block_sparse_moe.gate.weight", "blk.{i}.ffn_gate_inp.weight"),
    ("expert_gate", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "blk.{i}.ffn_gate_exps.weight"),
    ("expert_up", "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "blk.{i}.ffn_up_exps.weight"),
    ("expert_down", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "blk.{i}.ffn_down_exps.weight"),
)


# transformers' hidden_act names -> the gate activation of the gated MLP the kernels run
# (kernels.GATES): x * sigmoid(x), GELU's tanh form, GELU's erf form
HIDDEN_ACTS: Mapping[str, str] = MappingProxyType({
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"})


# every gate activation a family's gated MLP may have (kernels.GATES): hidden_act's, and gpt-oss's
# clamped SwiGLU (Family.gate)
GATES: tuple[str, ...] = ("silu", "gelu_tanh", "gelu", "swiglu_oai")


def _without(names: TensorNames, *roles: str) -> TensorNames:
    return tuple(row for row in names if row[0] not in roles)


@dataclass(frozen=True)
class Family:
    model_type: str                 # Hugging Face config.json `model_type`
    gguf_arch: str | None           # GGUF `general.architecture` llama.cpp's converter writes (None: none)
    tensors: TensorNames = _LLAMA_TENSORS
    # which projections carry a bias: a config key (read, default false) or a constant, as
    # transformers' class builds them
    qkv_bias: str | bool = False
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    # pre: RMSNorm before each sublayer; post: on its output, before the residual add; sandwich: both
    norm: Literal["pre", "post", "sandwich"] = "pre"
    hf_norm_offset: float = 0.0     # safetensors norms hold gain - offset (Gemma: 1 + w; its GGUFs store 1 + w)
    qk_norm: Literal["head", "proj"] | None = None  # RMSNorm of q and k before RoPE: per head, or over the whole projection
    activations: tuple[str, ...] = tuple(HIDDEN_ACTS)  # the hidden_act values its gated MLP takes
    activation_key: str = "hidden_act"  # the config key naming it (Gemma 3: hidden_activation)
    embed_scale: bool = False       # embeddings times sqrt(hidden_size) (Gemma)
    attn_scale_key: str | None = None  # scores times key ** -0.5 instead of head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    rope_per_layer_type: bool = False  # sliding layers rotate with their own base, unscaled (Gemma 3)
    softcaps: bool = False          # attn_logit_softcapping / final_logit_softcapping are read (Gemma 2), not refused
    gguf_unscaled_layers: int | None = None  # the layer count of the size whose attention scale GGUF does not hold
                                             # (Gemma's 27B): (hidden / heads) ** -0.5 there, as llama.cpp
    # none: every layer sees the whole context; all: `sliding_window` (null: none) on every layer;
    # flag: the same where `use_sliding_window` (Qwen3-MoE); layer_types: Qwen's `use_sliding_window`,
    # `max_window_layers` or `layer_types`; pattern: `layer_types`, else every
    # `sliding_window_pattern`-th layer full and the others sliding (Gemma 3)
    window: Literal["none", "all", "flag", "layer_types", "pattern"] = "none"
    defaults: tuple[tuple[str, Any], ...] = ()  # what the config class assumes for keys a config.json leaves out
    gguf_permuted_qk: bool = False  # llama.cpp's converter permutes q/k rows for its interleaved RoPE
    # tokens that end generation beside the GGUF's eos_token_id (which holds one): the ones the
    # family's generation_config.json lists, which llama.cpp also ends on (Gemma: <end_of_turn>)
    gguf_end_tokens: tuple[str, ...] = ()
    # a mixture of experts in place of every layer's MLP (the expert count: `num_experts`, else
    # `num_local_experts`; top-k: `num_experts_per_tok`), routed as transformers' class routes:
    # softmax over every expert in float32, the top k, their weights renormalized (a config key or
    # always) and multiplied in float32 (Mixtral) or first cast to the activations' dtype (Qwen3-MoE)
    moe: bool = False
    expert_size_key: str = "intermediate_size"  # the config key of an expert's MLP width
    norm_topk: str | bool = True
    expert_weights_float32: bool = False
    sparse_step_keys: bool = False  # decoder_sparse_step / mlp_only_layers choose dense layers (read, and
                                    # only every layer sparse supported)
    gguf_expert_size_key: str | None = None  # GGUF's key of an expert's width (None: feed_forward_length)
    topk_first: bool = False        # the top k of the router's logits, then a softmax over those k (gpt-oss)
    gate: str | None = None         # the experts' gate activation where the family fixes it (gpt-oss's
                                    # clamped SwiGLU, kernels.GATES), whatever hidden_act says
    # a checkpoint's expert tensors stacked as transformers' GptOssExperts holds them: (gate|up, its
    # bias, down, its bias) names, unstacked at load into the per-expert names above (weights/names.py)
    stacked_experts: tuple[str, str, str, str] | None = None
    gguf_yarn_truncate: bool = True  # YaRN's correction range rounded (transformers' default); gpt-oss's
                                     # config says false, which its GGUF does not record
    # config.json quantization_config methods of the family's published checkpoints that load as
    # stored (gpt-oss's "mxfp4": its stacked experts as blocks and scales, weights/mxfp4.py)
    stored_quantization: tuple[str, ...] = ()

    @property
    def sinks(self) -> bool:
        """Attention sinks: a learned logit per query head in each softmax's denominator (gpt-oss)."""
        return "sinks" in self.names

    @property
    def expert_biases(self) -> bool:
        return "router.bias" in self.names

    def __post_init__(self) -> None:
        roles = {role for role, _, _ in self.tensors}
        mlp = ("expert_gate" in roles) + ("gate_up" in roles) + ("gate" in roles)
        assert ("qkv" in roles) != ("q" in roles) and mlp == 1 and self.moe == ("router" in roles), self.model_type
        assert (self.norm != "post") == ("attn_norm" in roles) and (self.qk_norm is None) != ("q_norm" in roles)
        assert (self.norm != "pre") == ("attn_post_norm" in roles), self.model_type

    @property
    def names(self) -> Mapping[str, tuple[str, str]]:
        """role -> (Hugging Face name, GGUF name)."""
        return MappingProxyType({role: (hf, gguf) for role, hf, gguf in self.tensors})


FAMILIES: Mapping[str, Family] = MappingProxyType({f.model_type: f for f in (
    Family("llama", "llama", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
           defaults=(("rms_norm_eps", 1e-6),), gguf_permuted_qk=True),
    # llama.cpp writes Mistral as "llama"; its files load as that family
    Family("mistral", None, window="all", defaults=(("rms_norm_eps", 1e-6), ("sliding_window", 4096))),
    Family("qwen2", "qwen2", qkv_bias=True, window="layer_types",
           defaults=(("rms_norm_eps", 1e-6), ("use_sliding_window", False), ("sliding_window", 4096),
                     ("max_window_layers", 28))),
    Family("qwen3", "qwen3", _LLAMA_TENSORS + _QK_NORMS, qkv_bias="attention_bias", o_bias="attention_bias",
           qk_norm="head", window="layer_types",
           defaults=(("rms_norm_eps", 1e-6), ("head_dim", 128), ("use_sliding_window", False),
                     ("sliding_window", 4096), ("max_window_layers", 28))),
    Family("olmo2", "olmo2", _without(_LLAMA_TENSORS, "attn_norm", "mlp_norm") + _POST_NORMS + _QK_NORMS,
           qkv_bias="attention_bias", o_bias="attention_bias", norm="post", qk_norm="proj",
           defaults=(("rms_norm_eps", 1e-5),)),
    Family("phi3", "phi3", _without(_LLAMA_TENSORS, "q", "k", "v", "q.bias", "k.bias", "v.bias", "gate", "up",
                                    "gate.bias", "up.bias") + _FUSED,
           window="all", defaults=(("rms_norm_eps", 1e-5), ("sliding_window", None))),
    # soft-capped scores and logits; every other layer sliding
    Family("gemma2", "gemma2", _GEMMA_TENSORS, qkv_bias="attention_bias", o_bias="attention_bias", norm="sandwich",
           hf_norm_offset=1.0, activation_key="hidden_activation", embed_scale=True,
           attn_scale_key="query_pre_attn_scalar", window="pattern", softcaps=True, gguf_unscaled_layers=46,
           gguf_end_tokens=("<end_of_turn>",),
           defaults=(("rms_norm_eps", 1e-6), ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
                     ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("sliding_window_pattern", 2),
                     ("tie_word_embeddings", True), ("final_logit_softcapping", 30.0),
                     ("attn_logit_softcapping", 50.0))),
    # Gemma 3's text decoder (Gemma3ForCausalLM); soft-caps and bidirectional attention are refused
    Family("gemma3_text", "gemma3", _GEMMA_TENSORS + _QK_NORMS, qkv_bias="attention_bias", o_bias="attention_bias",
           norm="sandwich", hf_norm_offset=1.0, qk_norm="head", activation_key="hidden_activation",
           embed_scale=True, attn_scale_key="query_pre_attn_scalar", rope_per_layer_type=True, window="pattern",
           gguf_unscaled_layers=62, gguf_end_tokens=("<end_of_turn>",),
           defaults=(("rms_norm_eps", 1e-6), ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
                     ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("sliding_window_pattern", 6),
                     ("tie_word_embeddings", True), ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0))),
    # Qwen3's attention (QK-norm per head) over N experts, top-k; its window on every layer with
    # use_sliding_window; llama.cpp renormalizes the top-k weights of every qwen3moe file
    Family("qwen3_moe", "qwen3moe", _without(_LLAMA_TENSORS, *_DENSE_MLP) + _QK_NORMS + _QWEN_EXPERTS,
           qkv_bias="attention_bias", o_bias="attention_bias", qk_norm="head", window="flag", moe=True,
           expert_size_key="moe_intermediate_size", norm_topk="norm_topk_prob", sparse_step_keys=True,
           gguf_expert_size_key="expert_feed_forward_length",
           defaults=(("rms_norm_eps", 1e-6), ("use_sliding_window", False), ("sliding_window", 4096),
                     ("num_local_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 768),
                     ("norm_topk_prob", False))),
    # gpt-oss: biased attention with sinks, every other layer sliding (128), YaRN; 32 or 128 biased
    # experts with a clamped SwiGLU, top-4 of the router's logits softmaxed
    Family("gpt_oss", "gpt-oss", _without(_LLAMA_TENSORS, *_DENSE_MLP, "mlp_norm") + _GPT_OSS_TENSORS,
           qkv_bias="attention_bias", o_bias="attention_bias", window="pattern", moe=True, norm_topk=False,
           gguf_expert_size_key="expert_feed_forward_length", topk_first=True, gate="swiglu_oai",
           stacked_experts=_GPT_OSS_STACKED, gguf_yarn_truncate=False, stored_quantization=("mxfp4",),
           gguf_end_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
           defaults=(("rms_norm_eps", 1e-5), ("head_dim", 64), ("sliding_window", 128),
                     ("sliding_window_pattern", 2), ("num_local_experts", 128), ("num_experts_per_tok", 4),
                     ("intermediate_size", 2880), ("attention_bias", True), ("swiglu_alpha", 1.702),
                     ("swiglu_limit", 7.0), ("max_position_embeddings", 131072), ("rope_theta", 150000.0),
                     ("rope_parameters", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 4096,
                                          "rope_theta": 150000.0}))),
    # Mistral's attention over 8 experts, top-2; llama.cpp writes it as "llama" with expert tensors
    Family("mixtral", "llama", _without(_LLAMA_TENSORS, *_DENSE_MLP) + _MIXTRAL_EXPERTS, window="all", moe=True,
           expert_weights_float32=True, gguf_permuted_qk=True,
           defaults=(("rms_norm_eps", 1e-5), ("sliding_window", None), ("num_local_experts", 8),
                     ("num_experts_per_tok", 2))),
)})

# GGUF architecture and whether the file has experts (`{arch}.expert_count` > 0) -> the row
GGUF_FAMILIES: Mapping[tuple[str, bool], Family] = MappingProxyType(
    {(f.gguf_arch, f.moe): f for f in FAMILIES.values() if f.gguf_arch})

# Families users reach for that this decoder does not run (yet), by HF model_type and by GGUF
# architecture, and the math that is missing
NOT_YET: Mapping[str, str] = MappingProxyType({
    "qwen2_moe": "a mixture of experts with a shared expert",
    "deepseek_v2": "shared experts, grouped expert routing and multi-head latent attention",
    "deepseek_v3": "shared experts, grouped sigmoid expert routing and multi-head latent attention",
    "qwen2moe": "a mixture of experts with a shared expert",
    "deepseek2": "shared experts, grouped expert routing and multi-head latent attention",
})


def family(model_type: str) -> Family:
    """The row of a Hugging Face `model_type`; an UnsupportedArchitecture naming the ones there are."""
    if model_type not in FAMILIES:
        why = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise UnsupportedArchitecture(
            f"model_type {model_type!r}{why} is not supported; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def gguf_family(arch: Any, experts: bool = False) -> Family:
    """The row of a GGUF `general.architecture`, of its files with experts or without."""
    if (arch, experts) not in GGUF_FAMILIES:
        archs = ", ".join(f"{a} (with experts)" if moe else a for a, moe in GGUF_FAMILIES)
        if arch in NOT_YET:
            what = f" ({NOT_YET[arch]})"
        elif experts:
            what = " with experts (a mixture of experts)"
        else:
            what = " without experts" if (arch, True) in GGUF_FAMILIES else ""
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r}{what} is not supported; expected one of {archs}")
    return GGUF_FAMILIES[arch, experts]
