"""Training a draft head against a frozen target (teacher forcing on the target's own features).

Each step runs the target over a batch of token sequences (no gradients), then the head over the
pairs (f_t, e(s_{t+1})), and minimizes, per position, a smooth-L1 regression of the predicted
feature onto f_{t+1} (both through the target's final norm) plus `ce_weight` x the cross-entropy of the head's next-token distribution
(target's final norm + LM head on the predicted feature) against the target's own distribution
there. A checkpoint (head, optimizer, step, losses) is written every `checkpoint_every` steps; a
rerun with the same output folder resumes from it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quickdraft.engine import generate_tokens
from quickdraft.kernels import linear
from quickdraft.model.llama import Transformer
from quickdraft.sampling import SamplingParams
from quickdraft.spec.head import DraftHead, HeadProposer, head_config, save_head

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 4          # sequences per step
    max_len: int = 256           # tokens per sequence at most
    lr: float = 1e-3
    warmup: int = 20             # linear warm-up steps, then cosine decay to 10%
    ce_weight: float = 0.1       # EAGLE's weighting of the classification loss
    draft_vocab: int = 8192      # the most frequent tokens of the data the head may draft
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, found {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0 or self.ce_weight < 0:
            raise ValueError("lr must be > 0, warmup and ce_weight >= 0")


def _resumable(config: dict) -> dict:
    """The settings a resumed run must share with the checkpoint (more steps may be asked for)."""
    return {k: v for k, v in config.items() if k not in ("steps", "checkpoint_every")}


def draft_vocabulary(sequences: Sequence[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the data (ties by id), sorted by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(torch.tensor(s, dtype=torch.long), minlength=vocab_size)
    c = counts.tolist()
    order = sorted(range(vocab_size), key=lambda t: (-c[t], t))
    return torch.tensor(sorted(order[:min(size, vocab_size)]))


def lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_of(sequences: Sequence[list[int]], step: int, config: TrainConfig) -> list[list[int]]:
    """The step's sequences: a seeded shuffle of the data, cycled, so a resumed run continues it."""
    order = list(range(len(sequences)))
    epoch, offset = divmod(step * config.batch_size, len(sequences))
    random.Random(config.seed + epoch).shuffle(order)
    picked = [(offset + i) % len(sequences) for i in range(config.batch_size)]
    return [sequences[order[i]][:config.max_len] for i in picked]


def head_loss(target: Transformer, head: DraftHead, batch: list[list[int]],
              ce_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    device = target.device
    L = max(len(s) for s in batch)
    tokens = torch.tensor([s + [0] * (L - len(s)) for s in batch], device=device)    # [B, L]
    valid = torch.tensor([[t < len(s) for t in range(1, L)] for s in batch], device=device)  # [B, L-1]
    positions = torch.arange(L, device=device).expand(len(batch), L)
    with torch.no_grad():
        features = target(tokens, positions, target.new_cache(len(batch), L), last_n=1).hidden  # [B, L, D]
        embeds = target.embed(tokens[:, 1:]).to(features.dtype)
        p = torch.softmax(target.logits(features[:, 1:][valid]).float(), dim=-1)             # [N, V]
        best = p.argmax(-1)
        p = p[:, head.vocab]                                                                   # [N, Vd]
        lm_weight = target.lm_head.weight[head.vocab].to(features.dtype)
    head_cache = head.new_cache(L - 1, device, features.dtype, batch_size=len(batch))
    predicted = head(features[:, :-1], embeds, positions[:, :-1], head_cache)                  # [B, L-1, D]
    # regression after the target's final norm: what its LM head reads, scale-free (last-layer
    # features of real models carry a few huge outlier dimensions that would dominate otherwise)
    gain, eps = target.norm.fused
    regression = F.smooth_l1_loss(gain * F.rms_norm(predicted[valid], (predicted.shape[-1],), eps=eps),
                                  gain * F.rms_norm(features[:, 1:][valid], (predicted.shape[-1],), eps=eps))
    log_q = torch.log_softmax(linear(predicted[valid], lm_weight, norm=target.norm.fused).float(), dim=-1)
    ce = -(p * log_q).sum(-1).mean()  # the target's mass outside the draft vocabulary cannot be drafted
    agree = (head.vocab[log_q.argmax(-1)] == best).float().mean()
    parts = {"regression": regression.item(), "ce": ce.item(), "top1": agree.item()}
    return regression + ce_weight * ce, parts


def train_head(target: Transformer, sequences: Sequence[list[int]], config: TrainConfig, out: Path,
               target_name: str, progress: bool = True) -> dict:
    """Train (or resume training) a head for `target` on `sequences`; writes DIR/head.safetensors,
    DIR/head.json and DIR/checkpoint.pt. Returns the training record saved in head.json."""
    if not sequences:
        raise ValueError("no training sequences")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    head = DraftHead(head_config(target.config), draft_vocabulary(sequences, target.config.vocab_size,
                                                                  config.draft_vocab))
    head = head.to(device=target.device, dtype=target.compute_dtype)
    head.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    step, history = 0, []
    checkpoint = out / CHECKPOINT
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location=target.device, weights_only=False)
        if _resumable(state["config"]) != _resumable(dataclasses.asdict(config)):
            raise ValueError(f"{checkpoint} was written with other settings ({state['config']}); use another "
                             f"--out or delete it")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    bar = tqdm(total=config.steps, initial=step, desc="train-head", unit="step", disable=not progress)
    while step < config.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss, parts = head_loss(target, head, batch_of(sequences, step, config), config.ce_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        history.append({"step": step, "loss": loss.item(), **parts})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{parts['top1']:.2f}")
        if step % config.checkpoint_every == 0 or step == config.steps:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "history": history, "config": dataclasses.asdict(config)}, checkpoint)
    bar.close()
    record = {"config": dataclasses.asdict(config), "sequences": len(sequences), "steps": step,
              "final": history[-1] if history else {}}
    save_head(head.requires_grad_(False).eval(), target, out, target_name, training=record)
    (out / "history.json").write_text(json.dumps(history))
    return {**record, "history": history}


def acceptance(target: Transformer, head: DraftHead, prompts: Sequence[list[int]], k: int = 4,
               max_new_tokens: int = 32) -> tuple[float, float]:
    """(acceptance rate, tokens per target pass) of greedy decoding with the head on `prompts`."""
    drafted = accepted = committed = passes = 0
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        proposer = HeadProposer(head, target, prompt, params, len(prompt) + max_new_tokens + k + 1)
        stats = None
        for event in generate_tokens(target, prompt, params, frozenset(), proposer, k, adaptive=False):
            stats = event.stats
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
        committed, passes = committed + stats.committed_tokens, passes + stats.target_passes
    return (accepted / drafted if drafted else 0.0), (committed / passes if passes else 0.0)
