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
              ignore_eos: bool = False) -> tuple[list[int], float]:
    """Greedy ids from transformers' generate and the seconds it took (prefill included)."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None, **extra)
    elapsed = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), elapsed
