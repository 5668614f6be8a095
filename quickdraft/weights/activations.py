"""Which precision the integer kernel rounds a model's activations to (kernels/quant_matmul.c).

int16 keeps a quantized GGUF within float32 rounding of its dequantized self; int8 (one scale per
32 values) halves the multiplies per row of a multi-row pass, which is what verification and
prefill pay for on CPUs without VNNI, at a cost in agreement that depends on the model. The
default is int8 only for the models measured within the quality bar (top-1 agreement >= 0.99 and
mean KL <= 0.01 against the float32 dequantization, `quickdraft bench quality`, recorded in
docs/benchmarks.md); int16 for every other model.
"""
from __future__ import annotations

from quickdraft.errors import ModelLoadError
from quickdraft.kernels import ACTIVATION_BITS, QuantizedWeight
from quickdraft.weights.packaged import CHUNKED_MODELS
from quickdraft.weights.resolve import ModelSource

ACTIVATIONS = {f"int{bits}": bits for bits in ACTIVATION_BITS}  # {"int16": 16, "int8": 8}

# Measured with `bench quality --activations int8` (2,048 ShareGPT tokens): Qwen2.5-Coder-1.5B
# Q4_K_M top-1 0.993, KL 0.0007; its 0.5B draft top-1 0.990, KL 0.0004. Not here: SmolLM2-135M
# (top-1 0.979 with int8). Known by the files' sizes, so that the same file loaded by its path
# (as `bench plain --compare-llamacpp` does, or a user's own copy) gets the same default.
INT8_MEASURED_SIZES = frozenset(CHUNKED_MODELS[name].size for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))


def activation_bits(source: ModelSource, activations: str | None) -> int:
    """Bits for a model's activations: `activations` when given, else its measured default."""
    if activations is None:
        measured = source.kind == "gguf" and source.path.stat().st_size in INT8_MEASURED_SIZES
        return ACTIVATIONS["int8" if measured else "int16"]
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
    return ACTIVATIONS[activations]


def with_activation_bits(tensors: dict, bits: int) -> dict:
    """The tensors, quantized matrices set to round their activations to `bits` (no copy)."""
    return {k: v.with_activations(bits) if isinstance(v, QuantizedWeight) else v for k, v in tensors.items()}
