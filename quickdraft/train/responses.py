"""Training examples for a draft head: the target's own greedy responses to conversation prompts,
with the target's features recorded while it generates them.

A head is used on the target's own output, so that is what it learns from (self-distillation, as
Medusa-2 does): ShareGPT's answers were written by other models, and a 135M target agrees with
their next token only about a third of the time, so features of that text teach a head what the
target would *not* say. Generating through the batched engine also yields every feature for free:
the engine hands each step's features to proposers that want them, and `FeatureRecorder` is a
proposer that keeps them and proposes nothing, so its steps are plain decoding steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH
from quickdraft.spec.draft_contract import NO_DRAFT, Committed, Draft
from quickdraft.spec.sampling import SamplingParams

STORE_DTYPE = torch.bfloat16  # features on disk and in memory: half the bytes, noise far below the head's error


@dataclass
class Example:
    tokens: list[int]          # s_0 .. s_n: prompt and response
    features: torch.Tensor     # [n, D] f_0 .. f_{n-1}: the target's last-layer output at each fed position
    prompt_len: int            # s_0 .. s_{prompt_len-1} are the prompt


class FeatureRecorder:
    """A proposer that proposes nothing and records the tokens and features the engine commits."""
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.tokens = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.features: list[torch.Tensor] = []

    def commit(self, step: Committed) -> None:
        self.tokens.extend(step.tokens)
        self.features.append(step.features.to("cpu", STORE_DTYPE))

    def propose(self, k: int) -> Draft:
        return NO_DRAFT

    def example(self) -> Example:
        features = torch.cat(self.features)
        return Example(self.tokens[:len(features) + 1], features, self.prompt_len)


def generate_examples(target: Transformer, prompts: Sequence[list[int]], eos_token_ids: frozenset[int],
                      max_new_tokens: int, batch_size: int = 32, progress: bool = True) -> list[Example]:
    """Greedy responses to `prompts` (batched, plain decoding) as examples, in prompt order."""
    engine = Engine(target, EngineConfig(max_batch=batch_size,
                                         max_seq_len=max(map(len, prompts)) + max_new_tokens))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    recorders: dict[str, FeatureRecorder] = {}
    for i, prompt in enumerate(prompts):
        recorders[str(i)] = FeatureRecorder(prompt)
        engine.add(Request(list(prompt), params, eos_token_ids, recorders[str(i)], k=1, id=str(i)))
    bar = tqdm(total=len(prompts), desc="responses", unit="resp", disable=not progress)
    while engine.has_work():
        for _, event in engine.step():
            if event.error is not None:
                raise event.error
            bar.update(event.finish_reason is not None)
    bar.close()
    return [recorders[str(i)].example() for i in range(len(prompts))]


def save_examples(examples: Sequence[Example], path: Path, settings: dict) -> None:
    torch.save({"settings": settings, "tokens": [e.tokens for e in examples],
                "features": [e.features for e in examples], "prompt_lens": [e.prompt_len for e in examples]}, path)


def load_examples(path: Path, settings: dict) -> list[Example] | None:
    """The examples saved at `path` if they were made with `settings`, else None."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved.get("settings") != settings:
        return None
    return [Example(t, f, n) for t, f, n in zip(saved["tokens"], saved["features"], saved["prompt_lens"])]
