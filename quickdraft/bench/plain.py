"""`quickdraft bench plain`: plain greedy decoding, quickdraft vs transformers' generate.

Both run the same prompts in the same process, interleaved (A B A B) so machine drift hits both;
we report medians of tokens/s and the median of the paired ratios.
"""
from __future__ import annotations

import statistics
import time

import torch

from quickdraft.api import load, parse_dtype
from quickdraft.bench.hf_reference import hf_greedy, load_hf_model
from quickdraft.engine.loop import generate_tokens
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.spec.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France? Tell me about its history.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with an example in Python.",
    "Give me three tips for staying focused while studying.",
    "Summarize the causes of the First World War in a paragraph.",
    "What are the differences between a virus and a bacterium?",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "How do I make a good cup of tea?",
]


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A built-in prompt as the model takes it: a user turn of its chat template, or the text itself
    where the model has none (a base model, such as Gemma 3 270M; said by prompt_format)."""
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def prompt_format(tokenizer: Tokenizer) -> str:
    return "chat template" if tokenizer.has_chat_template else "raw text (the model has no chat template)"


def _ours_tokens_per_s(llm, ids: list[int], n: int) -> float:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    count = sum(len(ev.token_ids) for ev in generate_tokens(llm.model, ids, params, llm.tokenizer.eos_token_ids))
    return count / (time.perf_counter() - start)


def run_plain_bench(model: str, dtypes: list[str], n_prompts: int, max_new_tokens: int, repeats: int,
                    device: str = "cpu") -> list[dict]:
    rows = []
    for dtype_name in dtypes:
        dtype = parse_dtype(dtype_name)
        llm = load(model, device=device, dtype=dtype, prefix_cache_mb=0)  # each prompt timed from scratch
        hf = load_hf_model(llm.loaded.source, dtype, device)
        prompts = [prompt_ids(llm.tokenizer, p) for p in PROMPTS[:max(1, min(n_prompts, len(PROMPTS)))]]
        _ours_tokens_per_s(llm, prompts[0], 8)  # warm-up both sides
        hf_greedy(hf, prompts[0], 8, ignore_eos=True)
        ours, theirs, ratios = [], [], []
        for _ in range(repeats):
            for ids in prompts:
                a = _ours_tokens_per_s(llm, ids, max_new_tokens)
                toks, secs = hf_greedy(hf, ids, max_new_tokens, ignore_eos=True)
                b = len(toks) / secs
                ours.append(a)
                theirs.append(b)
                ratios.append(a / b)
        row = {"dtype": dtype_name, "quickdraft_tok_s": statistics.median(ours),
               "transformers_tok_s": statistics.median(theirs), "ratio": statistics.median(ratios),
               "runs": len(ratios)}
        rows.append(row)
        print(f"{dtype_name:>9}: quickdraft {row['quickdraft_tok_s']:6.1f} tok/s | transformers "
              f"{row['transformers_tok_s']:6.1f} tok/s | ratio {row['ratio']:.2f}x  "
              f"(median of {row['runs']} interleaved pairs)", flush=True)
        del hf, llm
    print("\n| dtype | quickdraft tok/s | transformers tok/s | ratio |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['quickdraft_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {r['ratio']:.2f}x |")
    print(f"\n(threads: {torch.get_num_threads()}, {max_new_tokens} new tokens, greedy)")
    return rows
