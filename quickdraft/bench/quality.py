"""`quickdraft bench quality`: a GGUF model run as stored against its float32 dequantization.

What the integer kernel changes is only the activations' rounding to int16 or int8 (the weights
are the file's own), and this measures it the way llama.cpp's perplexity tool does: teacher-forced over
real text (ShareGPT answers: training data, never benchmark questions), in windows, the mean
KL(p_float32 || p_as_stored) and the top-1 agreement per position; then greedy 64-token
continuations of HumanEval development prompts (problems 0-81 only), token for token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from quickdraft.bench.questions import load_humaneval
from quickdraft.engine.loop import generate_tokens
from quickdraft.errors import QuickdraftError
from quickdraft.model.llama import Transformer
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train.data import iter_sharegpt, sharegpt_path
from quickdraft.weights import LoadedModel, load_model


@dataclass(frozen=True)
class Quality:
    weights: str             # the model's weight format as run (block types, activation precision)
    tokens: int              # teacher-forced positions compared
    top1_agreement: float
    mean_kl: float           # KL(p_float32 || p_as_stored), nats
    max_kl: float
    greedy_prompts: int
    greedy_identical: int    # continuations identical for all new tokens
    greedy_matching_prefix: float  # mean leading tokens equal / new tokens

    def as_dict(self) -> dict:
        return asdict(self)


def text_ids(loaded: LoadedModel, n_tokens: int) -> list[int]:
    """ShareGPT assistant turns, tokenized and joined, until n_tokens."""
    ids: list[int] = []
    for messages in iter_sharegpt(sharegpt_path("bench")):
        for m in messages:
            if m["role"] == "assistant":
                ids += loaded.tokenizer.encode(m["content"])
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise QuickdraftError(f"the ShareGPT file holds fewer than {n_tokens} tokens of answers")


@torch.inference_mode()
def compare_teacher_forced(ref: Transformer, test: Transformer, ids: list[int], window: int) -> tuple[int, float, float, float]:
    """(positions, top-1 agreement, mean KL, max KL) over windows of `window` tokens."""
    agree, kls = 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]])
        T = chunk.shape[1]
        logp = [torch.log_softmax(m(chunk, torch.arange(T)[None], m.new_cache(1, T)).logits[0].double(), -1)
                for m in (ref, test)]
        agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
        kls.append((logp[0].exp() * (logp[0] - logp[1])).sum(-1))
    kl = torch.cat(kls)
    return kl.numel(), agree / kl.numel(), float(kl.mean()), float(kl.max())


def humaneval_prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    """The first n development problems' prompts (0-81 only: 82-163 are reserved for acceptance)."""
    return [loaded.tokenizer.encode(q.turns[0]) for q in load_humaneval("dev")[:n]]


def greedy_ids(model: Transformer, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [t for e in generate_tokens(model, prompt, params, frozenset()) for t in e.token_ids]


def run_quality(model: str, n_tokens: int = 2048, window: int = 512, prompts: int = 10,
                new_tokens: int = 64, activations: str | None = None) -> Quality:
    stored = load_model(model, activations=activations)
    if "Q" not in stored.model.weight_format:
        raise QuickdraftError(f"{model} holds no quantized GGUF matrices ({stored.model.weight_format}): "
                              f"nothing to compare")
    dense = load_model(model, dequantize=True)
    n, top1, mean_kl, max_kl = compare_teacher_forced(dense.model, stored.model, text_ids(stored, n_tokens), window)
    identical, prefix = 0, []
    for prompt in humaneval_prompts(stored, prompts):
        a, b = greedy_ids(dense.model, prompt, new_tokens), greedy_ids(stored.model, prompt, new_tokens)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        identical += same == len(a)
        prefix.append(same / len(a))
    return Quality(stored.model.weight_format, n, top1, mean_kl, max_kl, prompts, identical, sum(prefix) / len(prefix))
