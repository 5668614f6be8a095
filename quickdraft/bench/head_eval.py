"""`quickdraft bench head`: a draft head measured on held-out ShareGPT prompts, the openings of
conversations from train/data.py's HELD_OUT_FROM on, which `train-head` never trains on.

Two figures, issue 47's: the head's top-1 agreement with the target's own next token where it
reads the target's features (its first draft token: teacher-forced over the target's greedy
answers to the prompts), and greedy decoding with it (k-token chains, as it drafts them): the
acceptance rate and the tokens committed per target pass. The head may be a finished one (a
folder with head.safetensors) or a training run's latest checkpoint (a folder with
checkpoint.pt), so a run can be measured while it goes on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quickdraft.kernels import linear
from quickdraft.model.llama import Transformer
from quickdraft.proposers.head import WEIGHTS, DraftHead, as_target_runs, head_config, load_head, on_target
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train.features import prefill
from quickdraft.train.trainer import CHECKPOINT, acceptance


@dataclass(frozen=True)
class Training:
    """What a checkpoint's history says its head cost: steps, and the operations and wall time of
    those whose entries record them (steps trained before the history kept them count in `steps`
    alone)."""
    steps: int
    timed_steps: int
    flops: float
    seconds: float

    @classmethod
    def of(cls, state: dict) -> Training:
        timed = [h for h in state["history"] if "seconds" in h and "flops" in h]
        return cls(state["step"], len(timed), sum(h["flops"] for h in timed), sum(h["seconds"] for h in timed))


@dataclass(frozen=True)
class HeadScore:
    prompts: int
    positions: int           # answer positions the agreement counts
    top1: float              # the head's first draft token == the target's greedy next token
    acceptance: float        # greedy decoding with the head: accepted / drafted
    tokens_per_pass: float   # ... committed tokens per target pass
    training: Training | None  # what the training behind it cost, where a checkpoint records it

    def as_dict(self) -> dict:
        return asdict(self)


def head_from(path: Path, target: Transformer) -> tuple[DraftHead, Training | None]:
    """The head in `path` (head.safetensors, checked against the target) or, without one, the head
    of the training checkpoint there, either as it runs (load_head: Q8_0 blocks over a GGUF target);
    and, from a checkpoint, what its training cost."""
    if (path / WEIGHTS).is_file() or not (path / CHECKPOINT).is_file():
        head = load_head(path, target)
        return head, None
    state = torch.load(path / CHECKPOINT, map_location=target.device, weights_only=False)
    head = DraftHead(head_config(target.config, state["config"].get("mlp_width", 0)), state["head"]["vocab"],
                     state["config"].get("feature_layers", ()))
    head.load_state_dict(state["head"])
    return as_target_runs(on_target(head, target).requires_grad_(False).eval(), target), Training.of(state)


@torch.inference_mode()
def first_token_agreement(target: Transformer, head: DraftHead, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(agreeing, counted): over the answer's positions, whether the head's first draft token from
    the target's feature there is the target's own next token. Pair t (f_t, s_{t+1}) predicts
    f_{t+1}, hence s_{t+2}; pairs from the prompt's last token on count, as in training."""
    tokens = prompt + answer
    features = prefill(target, tokens).to(target.device, target.compute_dtype)  # [n, F], n = len(tokens) - 1
    columns = head.columns(target)
    features = features if columns is None else features[:, columns]          # [n, F_head]: the layers it reads
    n = features.shape[0]
    if n < 2:
        return 0, 0
    ids = torch.tensor(tokens, device=target.device)
    embeds = target.embed(ids[1:n][None]).to(target.compute_dtype)             # [1, n-1, D]
    positions = torch.arange(n - 1, device=target.device)[None]
    predicted = head(head.read(features[None, :-1]), embeds, positions, head.new_cache(n - 1, target.device,
                                                                            target.compute_dtype))[0]
    logits = linear(predicted, head.output_rows(target), norm=target.norm.fused)  # [n-1, Vd], as drafting reads them
    drafted = head.vocab[logits.argmax(-1)]                                      # [n-1] token ids
    counted = range(len(prompt) - 1, n - 1)                                      # pairs predicting answer tokens
    agree = sum(int(drafted[t]) == tokens[t + 2] for t in counted)
    return agree, len(counted)


def score_head(target: Transformer, head: DraftHead, prompts: list[list[int]], eos: frozenset[int],
               k: int, new_tokens: int, training: Training | None = None) -> HeadScore:
    from quickdraft.engine.loop import generate_tokens
    agree = counted = 0
    params = SamplingParams(max_new_tokens=new_tokens)
    for prompt in prompts:
        answer = [t for event in generate_tokens(target, prompt, params, eos, None, 0) for t in event.token_ids]
        a, c = first_token_agreement(target, head, prompt, [t for t in answer if t not in eos])
        agree, counted = agree + a, counted + c
    rate, per_pass = acceptance(target, head, prompts, k=k, max_new_tokens=new_tokens)
    return HeadScore(len(prompts), counted, agree / counted if counted else 0.0, rate, per_pass, training)
