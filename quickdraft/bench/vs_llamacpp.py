"""`quickdraft bench plain --compare-llamacpp`: quickdraft and llama.cpp on one GGUF file, the same
token ids and the same thread count, measured in one run (schedule and report: bench/compare.py).

Owns turning the options into token ids and a `CompareConfig`, and the run's description.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from quickdraft.api import parse_dtype
from quickdraft.bench.compare import CompareConfig, Comparison, load_engines, run_comparison
from quickdraft.bench.llamacpp_engine import LlamaCppEngine, import_llama_cpp, worker_environment
from quickdraft.bench.plain import PROMPTS, prompt_format, prompt_ids
from quickdraft.bench.qd_engine import QuickdraftEngine
from quickdraft.errors import QuickdraftError
from quickdraft.kernels import kernel_info
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.weights.resolve import resolve_model

PROMPT_ROOM = 128  # tokens kept for a built-in chat prompt (with any template's system turn) in n_ctx


def compare_config(tokenizer: Tokenizer, n_prompts: int, max_new_tokens: int, prefill_tokens: Sequence[int],
                   context: int, max_q: int, repeats: int) -> CompareConfig:
    """Chat prompts for decoding (the text alone for a model without a chat template); for prefill
    and t(q), the first tokens of the prompts' text run together (any text: a dense model's pass costs
    the same whatever the tokens; a mixture's depends on how many experts they route to, the same
    text for both engines)."""
    prompts = tuple(tuple(prompt_ids(tokenizer, p)) for p in PROMPTS[:n_prompts])
    text, ids = "", []
    while len(ids) < max(*prefill_tokens, context + max_q):
        text += " ".join(PROMPTS) + "\n"
        ids = tokenizer.encode(text)
    return CompareConfig(prompts, max_new_tokens, tuple(tuple(ids[:n]) for n in prefill_tokens), tuple(ids[:context]),
                         tuple(ids[context:context + max_q]), tuple(range(1, max_q + 1)), repeats)


def _read_through(path: Path) -> None:
    """Read the file once so that both engines' loads find it in the page cache (neither pays the
    disk for the other)."""
    with path.open("rb") as f:
        while f.read(16 << 20):
            pass


def run_llamacpp_comparison(model: str, device: str, dtype: str, threads: int, n_prompts: int,
                            max_new_tokens: int, repeats: int, prefill_tokens: Sequence[int] = (512,), context: int = 256,
                            max_q: int = 17, command: str = "", activations: str | None = None) -> Comparison:
    if not 1 <= n_prompts <= len(PROMPTS):
        raise QuickdraftError(f"--prompts must be 1..{len(PROMPTS)}, found {n_prompts}")
    lc = import_llama_cpp()  # before any slow load
    source = resolve_model(model)
    if source.kind != "gguf":
        raise QuickdraftError(f"--compare-llamacpp runs llama.cpp on the same file, so it needs a GGUF "
                              f"model; {model!r} is a {source.kind} directory")
    torch.set_num_threads(threads)
    torch_dtype = parse_dtype(dtype)
    _read_through(source.path)
    n_ctx = max(*prefill_tokens, context + max_q, PROMPT_ROOM + max_new_tokens)
    log = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    engines, load_s = load_engines(
        [("quickdraft", lambda: QuickdraftEngine.load(str(source.path), device, torch_dtype, n_ctx, activations)),
         ("llama.cpp", lambda: LlamaCppEngine(source.path, threads, n_ctx, n_batch=max(512, *prefill_tokens)))],
        log=log)
    ours, theirs = engines
    room = ours.model.config.max_position_embeddings
    if n_ctx > room:
        raise QuickdraftError(f"the measurements need {n_ctx} positions, the model has {room}; "
                              f"lower --prefill-tokens, --context or --max-new-tokens")
    cfg = compare_config(ours.loaded.tokenizer, n_prompts, max_new_tokens, prefill_tokens, context, max_q, repeats)
    assert max(map(len, cfg.prompts)) <= PROMPT_ROOM, "a built-in chat prompt outgrew PROMPT_ROOM"
    config = {"command": command, "model": model, "model_file": str(source.path),
              "weights": ours.model.weight_format, "device": device,
              "dtype": dtype, "threads": threads, "torch_threads": torch.get_num_threads(),
              "prompts": len(cfg.prompts), "prompt_format": prompt_format(ours.loaded.tokenizer),
              "prompt_tokens": [len(p) for p in cfg.prompts],
              "max_new_tokens": max_new_tokens, "repeats": repeats, "context": context,
              "torch": torch.__version__, "quickdraft_kernel": kernel_info().as_dict(), "llama_cpp_python": lc.__version__,
              "llama_cpp_system_info": theirs.system_info(), "llama_cpp_flash_attn": True,
              # how each engine's OpenMP threads wait (llama.cpp runs in a process of its own)
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "llama_cpp_omp_wait_policy": worker_environment().get("OMP_WAIT_POLICY"),
              "machine": platform.machine(), "processor": platform.processor(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        return run_comparison(engines, load_s, cfg, config, log=log)
    finally:
        theirs.close()
