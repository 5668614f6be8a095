"""transformers as the reference and the baseline: the same checkpoint loaded by transformers."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.weights.resolve import ModelSource


def load_hf_model(source: ModelSource, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise QuickdraftError("this comparison needs transformers: pip install -e '.[test]'") from None
    if source.kind == "gguf":
        # transformers dequantizes GGUF to float32; cast afterwards like our loader does.
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
              ignore_eos: bool = False, eos_token_ids: Sequence[int] | None = None) -> tuple[list[int], float]:
    """Greedy ids from transformers' generate and the seconds it took (prefill included).
    `eos_token_ids` overrides the model's generation config (e.g. to stop where quickdraft does)."""
    return _hf_generate(model, prompt_ids, max_new_tokens, ignore_eos, eos_token_ids)


@torch.inference_mode()
def hf_prompt_lookup(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     ignore_eos: bool = False, eos_token_ids: Sequence[int] | None = None,
                     num_tokens: int = 10) -> tuple[list[int], float]:
    """Greedy ids from transformers' prompt lookup decoding (`prompt_lookup_num_tokens`: n-gram
    drafts from the prompt, verified by the model) and the seconds it took (prefill included)."""
    return _hf_generate(model, prompt_ids, max_new_tokens, ignore_eos, eos_token_ids,
                        prompt_lookup_num_tokens=num_tokens)


def _hf_generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool,
                 eos_token_ids: Sequence[int] | None, **extra) -> tuple[list[int], float]:
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    if ignore_eos:
        extra["min_new_tokens"] = max_new_tokens
    if eos_token_ids is not None:
        extra["eos_token_id"] = list(eos_token_ids)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None, **extra)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    elapsed = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), elapsed
