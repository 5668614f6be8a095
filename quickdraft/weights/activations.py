"""Which precision the integer kernel rounds a model's activations to (kernels/quant_matmul.c).

int16 keeps a quantized GGUF within float32 rounding of its dequantized self; int8 (one scale per
32 values) halves the multiplies per row of a multi-row pass, which is what verification and
prefill pay for on CPUs without VNNI, at a cost in agreement that depends on the model.

The rule, for a GGUF run as stored with no --activations: int8 when, over CALIBRATION_TOKENS
tokens of a fixed text, the model with int8 activations picks the same top token as with int16
at >= TOP1 of the positions and its mean KL from the int16 distribution is <= MAX_KL; else int16.
It is measured at the file's first load (a message says so; a few seconds) and recorded in the
user's cache, keyed by the file's content (its size and the hashes of its first and last MiB),
so a copy of a file loaded by another path gets the same answer. The packaged files were
measured against their float32 dequantization with `quickdraft bench quality` over 2,048
ShareGPT tokens (docs/results.md) and are known here by the same key.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from quickdraft.errors import ModelLoadError
from quickdraft.kernels import ACTIVATION_BITS, QuantizedWeight
from quickdraft.kernels.build import cache_dir
from quickdraft.weights.resolve import ModelSource

ACTIVATIONS = {f"int{bits}": bits for bits in ACTIVATION_BITS}  # {"int16": 16, "int8": 8}
TOP1, MAX_KL = 0.99, 0.01
CALIBRATION_TOKENS = 512
CHUNK = 128  # calibration tokens per forward: logits of a 152k vocabulary stay ~80 MB

# bench quality --activations int8, 2,048 ShareGPT tokens: Qwen2.5-Coder-1.5B Q4_K_M top-1 0.993,
# KL 0.0007; its 0.5B draft top-1 0.990, KL 0.0004; SmolLM2-135M Q4_1 top-1 0.979 (int16).
MEASURED = {"1117320768:4372a4731dd840e7af7ded48dba7b011": 8,   # qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
            "491400064:c15579455349a4306338a592fc79b721": 8,    # qwen2.5-coder-0.5b-instruct.gguf
            "98362432:8597a9397a0b4f90737b9ccba5b67510": 16}    # SmolLM2-135M-Instruct.Q4_1.gguf

CALIBRATION = (
    "The committee met on a grey Tuesday morning to decide what to do about the old bridge. Some "
    "wanted it repaired, others wanted a new one built a little further down the river, where the "
    "banks are lower and the ground is firmer. After two hours of talk they agreed on a study.\n\n"
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "Q: How many minutes are there in a week? A: There are 60 minutes in an hour, 24 hours in a day "
    "and 7 days in a week, so 60 * 24 * 7 = 10080 minutes.\n\n"
    "Dear Ms. Alvarez, thank you for your letter of the 3rd. I am sorry to hear that the parcel "
    "arrived damaged; we will send a replacement at once and a prepaid label for the return. Please "
    "let us know if there is anything else we can do. Kind regards, the customer service team.\n\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, whose green pigment, chlorophyll, absorbs mostly red and blue light "
    "and reflects green. Without it there would be almost no oxygen in the air we breathe.\n"
) * 3


def activation_bits(source: ModelSource, activations: str | None) -> int | None:
    """Bits for a model's activations: `activations` when given; else for a GGUF the recorded
    answer of the rule above, None where it is still to be measured (choose_bits, once the model
    is built); int16 for anything else (a float model quantized at load; a Hugging Face directory's
    MXFP4 experts, not measured)."""
    if activations is not None:
        if activations not in ACTIVATIONS:
            raise ModelLoadError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        return ACTIVATIONS[activations]
    if source.kind != "gguf":
        return 16
    key = fingerprint(source.path)
    return MEASURED.get(key) or _recorded().get(key)


def choose_bits(model: torch.nn.Module, ids: list[int], source: ModelSource) -> int:
    """Measure the rule on `model` (built with int16 activations) over `ids`, the calibration
    text's tokens; record the answer and leave the model with it."""
    print(f"quickdraft: measuring int8 against int16 activations on {source.path.name} (first load of this file "
          f"only, a few seconds)...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    ids = [t for t in ids if t < model.config.vocab_size][:CALIBRATION_TOKENS]  # a tokenizer may know more ids
    p16 = _log_probs(model, ids)
    set_activation_bits(model, 8)
    p8 = _log_probs(model, ids)
    top1 = (p16.argmax(-1) == p8.argmax(-1)).float().mean().item()
    kl = (p16.exp() * (p16 - p8)).sum(-1).mean().item()
    bits = 8 if top1 >= TOP1 and kl <= MAX_KL else 16
    set_activation_bits(model, bits)
    _record(fingerprint(source.path), bits)
    print(f"quickdraft: int8 agrees with int16 on {100 * top1:.1f}% of {len(ids)} tokens (mean KL {kl:.4f}; int8 "
          f"needs >= {100 * TOP1:g}% and <= {MAX_KL:g}): int{bits} activations ({time.perf_counter() - start:.1f} s; "
          f"--activations overrides)", file=sys.stderr, flush=True)
    return bits


def with_activation_bits(tensors: dict, bits: int) -> dict:
    """The tensors, quantized matrices set to round their activations to `bits` (no copy)."""
    return {k: v.with_activations(bits) if isinstance(v, QuantizedWeight) else v for k, v in tensors.items()}


def set_activation_bits(model: torch.nn.Module, bits: int) -> None:
    """Every quantized matrix of a built model set to `bits` (no copy; the fused layers repacked
    at their next use). A matrix shared by two modules (tied embeddings) stays shared."""
    swapped: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, QuantizedWeight):
                setattr(module, name, swapped.setdefault(id(value), value.with_activations(bits)))
        if "fused" in vars(module):  # a block's layer.c packing or a layer's experts' (experts.c): made with the bits
            module.fused = None


def fingerprint(path: Path) -> str:
    """A file's size and the hash of its first and last MiB: the same for a copy, cheap to read."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{size}:{digest.hexdigest()[:32]}"


def _log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[n, V] log-probabilities of the next token at every position of `ids`, CHUNK tokens a pass."""
    cache, out = model.new_cache(1, len(ids)), []
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = torch.tensor([ids[start:start + CHUNK]], device=model.device)
            positions = torch.arange(start, start + chunk.shape[1], device=model.device)[None]
            out.append(torch.log_softmax(model(chunk, positions, cache).logits[0].float(), -1))
    return torch.cat(out)


def _records() -> Path:
    return cache_dir().parent / "activations.json"


def _recorded() -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(_records().read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _record(key: str, bits: int) -> None:
    """Kept best-effort: a cache that cannot be written means measuring again next time."""
    try:
        _records().parent.mkdir(parents=True, exist_ok=True)
        tmp = _records().with_suffix(".tmp")
        tmp.write_text(json.dumps({**_recorded(), key: bits}, indent=1))
        tmp.replace(_records())
    except OSError:
        pass
