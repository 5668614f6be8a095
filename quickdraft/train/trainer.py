"""Training a draft head against a frozen target on recorded examples (train/responses.py: the
target's own responses and its features there).

Each step runs the head `unroll` times over a batch's pairs (f_t, e(s_{t+1})). The first pass reads
the target's features; pass j reads, at every position, the feature pass j-1 predicted there, as
the j-th draft step reads the head's own prediction: a head trained on exact features alone drifts
off after its first draft token (training-time test, as in HASS and EAGLE-3). Each pass's loss is a
smooth-L1 regression of the predicted feature onto f_{t+1} (both through the target's final norm)
plus `ce_weight` x the cross-entropy of the head's next-token distribution (final norm + LM head
over the draft vocabulary) against the target's own distribution there; pass j weighs
`unroll_decay`^j. Losses count on the response positions only, where the head drafts (the
prompt's pairs run for context), as EAGLE masks user turns. A checkpoint (the head, step, losses:
checkpoint.pt, small enough for a repository to keep) and the optimizer's state beside it
(optimizer.pt, twice the head's size) are written every `checkpoint_every` steps; a rerun with the
same output folder resumes, exactly where optimizer.pt is there for that step, else with the
optimizer's moments started afresh (they rebuild within a few dozen steps).

The head's weights and the optimizer stay float32; with `dtype` bfloat16 (`auto`: where the CPU
multiplies bfloat16 natively, AMX or AVX512-BF16, or on a CUDA GPU that does) the matmuls of the
head and of the losses run in bfloat16 under autocast, and the losses' reductions in float32.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quickdraft.engine.loop import generate_tokens
from quickdraft.kernels.build import cpu_flags
from quickdraft.model.llama import Transformer
from quickdraft.proposers.head import DraftHead, HeadProposer, head_config, on_target, save_head
from quickdraft.spec.sampling import SamplingParams
from quickdraft.train.features import Example

CHECKPOINT, OPTIMIZER = "checkpoint.pt", "optimizer.pt"
DTYPES = ("auto", "float32", "bfloat16")
CE_WEIGHT = 0.1  # EAGLE's weighting of the classification loss beside the feature regression
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names of native bfloat16 matmuls


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8          # examples per step
    max_len: int = 384           # positions per example at most
    lr: float = 1e-3
    warmup: int = 20             # linear warm-up steps, then cosine decay to 10%
    ce_weight: float | None = None  # of the classification loss; None: a resumed run's, else CE_WEIGHT
    unroll: int = 3              # passes per step: 1 on the target's features, then on the head's own
    unroll_decay: float = 0.8    # weight of pass j: decay^j
    draft_vocab: int = 8192      # the most frequent tokens of the data the head may draft
    checkpoint_every: int = 100
    seed: int = 0
    dtype: str = "auto"          # of the matmuls (DTYPES; auto: training_dtype's choice)
    feature_layers: tuple[int, ...] = ()  # the target's layers the head reads (DraftHead; (): the last alone)
    mlp_width: int = 0           # the head's MLP width (head_config; 0: the target's)
    length_groups: int = 2       # a step's examples run in this many passes of like lengths (by_length)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_len", "checkpoint_every", "unroll", "length_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, found {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0 or (self.ce_weight or 0) < 0 or not 0 < self.unroll_decay <= 1:
            raise ValueError("lr must be > 0, warmup and ce_weight >= 0, unroll_decay in (0, 1]")
        if self.mlp_width < 0:
            raise ValueError(f"mlp_width must be >= 0 (0: the target's), found {self.mlp_width}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, found {self.dtype!r}")


def _resumable(config: dict) -> dict:
    """The settings a resumed run must share with the checkpoint: more steps may be asked for,
    another dtype (the weights and the optimizer's state are float32 in either), and another weight
    on the cross-entropy (`ce_weight`: the same head and data, another objective from here on). A checkpoint
    written before heads could fuse layers read the last layer alone."""
    config = {"feature_layers": (), "mlp_width": 0, **config}
    return {k: tuple(v) if k == "feature_layers" else v for k, v in config.items()
            if k not in ("steps", "checkpoint_every", "dtype", "length_groups", "ce_weight")}


def training_dtype(name: str, device: torch.device) -> torch.dtype:
    """The matmuls' dtype `name` asks for on `device`; auto: bfloat16 where the hardware multiplies
    it natively (elsewhere it is emulated, slower than float32), else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        native = device.type == "cpu" and bool(set(BF16_FLAGS) & (cpu_flags() or set()))
    return torch.bfloat16 if native else torch.float32


def draft_vocabulary(examples: Sequence[Example], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the responses (ties by id), sorted by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(torch.tensor(e.tokens[e.prompt_len:], dtype=torch.long), minlength=vocab_size)
    c = counts.tolist()
    order = sorted(range(vocab_size), key=lambda t: (-c[t], t))
    return torch.tensor(sorted(order[:min(size, vocab_size)]))


def lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_of(examples: Sequence[Example], step: int, config: TrainConfig) -> list[Example]:
    """The step's examples: a seeded shuffle of the data, cycled, so a resumed run continues it."""
    order = list(range(len(examples)))
    epoch, offset = divmod(step * config.batch_size, len(examples))
    random.Random(config.seed + epoch).shuffle(order)
    picked = [examples[order[(offset + i) % len(examples)]] for i in range(config.batch_size)]
    return [Example(e.tokens[:config.max_len + 1], e.features[:config.max_len], e.prompt_len) for e in picked]


def by_length(batch: Sequence[Example], groups: int) -> list[list[Example]]:
    """The batch in up to `groups` parts of like lengths, shortest first: a part's rows are padded to
    its own longest, not the batch's (8 rows padded to the longest ran a third more positions than
    they hold, SmolLM2's answers)."""
    ordered = sorted(batch, key=lambda e: len(e.features))
    size = -(-len(ordered) // groups)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def counted(batch: Sequence[Example]) -> int:
    """The pairs of a batch whose predictions count (loss_positions)."""
    return sum(max(0, len(e.features) - max(e.prompt_len, 1)) for e in batch)


def loss_positions(batch: Sequence[Example], pairs: int) -> torch.Tensor:
    """[B, pairs] bool: the pairs whose predictions count. Pair t predicts f_{t+1}, hence the token
    s_{t+2}; the head's first draft follows the target's first response token, so the pairs from
    t = prompt_len - 1 on count (the prompt's pairs still run: they are the head's attention context,
    as when drafting), up to the last pair with a known f_{t+1}."""
    return torch.tensor([[e.prompt_len - 1 <= t < len(e.features) - 1 for t in range(pairs)] for e in batch],
                        dtype=torch.bool).reshape(len(batch), pairs)


class LogSumExp(torch.autograd.Function):
    """logsumexp of each row of logits [N, V] in float32 whatever their dtype, and the row's argmax;
    the gradient, softmax x the incoming one, is made in the buffer the forward's exp left. 7 passes
    over [N, V] in all, where log_softmax, a product with p, an argmax and their backward took about
    twice as many: most of a bfloat16 step's time outside the matmuls."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.to(torch.float32, copy=True)  # [N, V]: overwritten by its exp
        top, best = z.max(-1)
        e = z.sub_(top[:, None]).exp_()
        total = e.sum(-1)
        ctx.save_for_backward(e, total)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(best)
        return top + total.log(), best

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        e, total = ctx.saved_tensors
        return e.mul_((grad / total)[:, None]).to(ctx.logits_dtype)


def head_loss(target: Transformer, head: DraftHead, batch: list[Example],
              config: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss (module docstring) and its parts. In float32 but for the matmuls, which an
    enclosing autocast may run in bfloat16."""
    device, dtype = target.device, torch.float32  # the head's weights' dtype (new_head)
    n = max(len(e.features) for e in batch)  # features per row; pairs per row: n - 1
    D = target.config.hidden_size
    features = torch.zeros(len(batch), n, batch[0].features.shape[-1], device=device, dtype=dtype)  # [B, n, F]
    tokens = torch.zeros(len(batch), n + 1, dtype=torch.long, device=device)                      # [B, n+1]
    for b, e in enumerate(batch):
        features[b, :len(e.features)] = e.features.to(device, dtype)
        tokens[b, :len(e.tokens)] = torch.tensor(e.tokens, device=device)
    valid = loss_positions(batch, n - 1).to(device)
    positions = torch.arange(n - 1, device=device).expand(len(batch), n - 1)
    gain, eps = target.norm.weight.to(dtype), target.norm.eps
    with torch.no_grad():
        embeds = target.embed(tokens[:, 1:n]).to(dtype)                      # [B, n-1, D]: e(s_{t+1})
        lm_weight = target.lm_head.weight[head.vocab].to(dtype)              # [Vd, D]
        goal = features[:, 1:, -D:][valid]                                   # [N, D]: f_{t+1}, the last layer's
        goal_normed = gain * F.rms_norm(goal, (D,), eps=eps)                 # what the LM head reads
        p = torch.softmax(F.linear(goal_normed, lm_weight).float(), dim=-1)  # [N, Vd]
        best = p.argmax(-1)
        # H(p, q) = logsumexp(z) - p.z with z = W h: p.z = h.(p W), and p W is the same every pass
        p_weight = (p @ lm_weight).float()                                   # [N, D]
    fused = head.read(features[:, :-1])  # [B, n-1, D]: what the head reads at the target's positions
    inputs, total, parts = fused, torch.zeros((), device=device), {}
    for j in range(config.unroll):
        predicted = head(inputs, embeds, positions, head.new_cache(n - 1, device, dtype, len(batch)))  # [B, n-1, D]
        # after the target's final norm: what its LM head reads; the regression there is scale-free
        # (last-layer features of real models carry a few huge outlier dimensions that would
        # dominate otherwise)
        normed = gain * F.rms_norm(predicted[valid].float(), (D,), eps=eps)  # [N, D]
        regression = F.smooth_l1_loss(normed, goal_normed)
        log_total, mine_best = LogSumExp.apply(F.linear(normed, lm_weight))
        ce = (log_total - (normed * p_weight).sum(-1)).mean()
        total = total + config.unroll_decay ** j * (regression + config.ce_weight * ce)
        top1 = (mine_best == best).float().mean().item()
        parts.update({"regression": regression.item(), "ce": ce.item(), "top1": top1} if j == 0 else
                     {f"top1_{j + 1}": top1})
        # the next pass reads at position t this pass's prediction of f_t (position 0: the target's)
        inputs = torch.cat([fused[:, :1], predicted[:, :-1].detach().to(dtype)], dim=1)
    return total, parts


def new_head(target: Transformer, examples: Sequence[Example],
             config: TrainConfig) -> tuple[DraftHead, torch.optim.Optimizer]:
    """An untrained head for `target` (float32, whatever the target's dtype) and its optimizer."""
    torch.manual_seed(config.seed)
    vocab = draft_vocabulary(examples, target.config.vocab_size, config.draft_vocab)
    head = DraftHead(head_config(target.config, config.mlp_width), vocab, config.feature_layers)
    head = on_target(head, target).float().requires_grad_(True).train()
    return head, torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)


def step_flops(head: DraftHead, batch: Sequence[Example], config: TrainConfig) -> float:
    """Floating-point operations of one training step on `batch` (2 per multiply-add), counted
    from the shapes head_loss runs: per pass the head's layer over every padded position (input
    projection, attention projections, causal attention, MLP) and the LM head over the draft
    vocabulary at the positions that count, the fuse once, the target's distributions there once.
    A backward pass costs a forward's twice where inputs and weights both take gradients, once where
    one does (the frozen LM head; the input projection but in a fusing head, whose passes all read
    the fuse's output at position 0). The learning curve's x axis."""
    c, D = head.config, head.config.hidden_size
    n = max(len(e.features) for e in batch)                   # features per row: n - 1 pairs
    positions = len(batch) * (n - 1)
    valid = counted(batch)
    lm, fc = valid * len(head.vocab) * D, positions * 2 * D * D
    layer = positions * (D * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * D
                         + 3 * D * c.intermediate_size)      # wqkv, wo, gate|up and down
    attention = len(batch) * (n - 1) * n // 2 * 2 * c.num_heads * c.head_dim  # scores and weighted values
    fuse = positions * len(head.feature_layers) * D * D if head.fuse is not None else 0
    passes = config.unroll * (3 * (layer + attention) + (3 if fuse else 2) * fc + 2 * lm)
    return 2.0 * (passes + 2 * fuse + 2 * lm)


def train_steps(target: Transformer, head: DraftHead, optimizer: torch.optim.Optimizer,
                examples: Sequence[Example], config: TrainConfig, step: int = 0) -> Iterator[dict]:
    """Training steps `step` + 1 .. config.steps, each yielding its history entry (with its wall
    seconds and step_flops: the learning curve's hours and operations)."""
    config = with_ce_weight(config, None)  # a fresh run's where none is decided (step_rate's)
    dtype = training_dtype(config.dtype, target.device)
    while step < config.steps:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        groups = by_length(batch_of(examples, step, config), config.length_groups)
        total, loss, parts = sum(map(counted, groups)), 0.0, {}
        optimizer.zero_grad(set_to_none=True)
        # the batch's loss: each part's mean weighted by its share of the counted pairs (usable_examples
        # leaves none without one, so no part's mean is of nothing)
        for group in groups:
            weight = counted(group) / total
            with torch.autocast(target.device.type, dtype=dtype, enabled=dtype != torch.float32):
                part, values = head_loss(target, head, group, config)
            (weight * part).backward()
            loss += weight * part.item()
            parts = {k: parts.get(k, 0.0) + weight * v for k, v in values.items()}
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        yield {"step": step, "loss": loss, **parts, "ce_weight": config.ce_weight,
               "seconds": time.perf_counter() - start, "flops": sum(step_flops(head, group, config) for group in groups)}


def usable_examples(examples: Sequence[Example], config: TrainConfig) -> list[Example]:
    """The examples a head can learn from; none is an error."""
    # a pair to learn from within the max_len positions a step reads (a batch without one has a NaN loss)
    examples = [e for e in examples if min(len(e.features), config.max_len) > max(1, e.prompt_len)]
    if not examples:
        raise ValueError(f"no training examples (each needs a prompt and at least two response tokens, the first "
                         f"within max_len = {config.max_len} positions)")
    return examples


def save_checkpoint(out: Path, head: DraftHead, optimizer: torch.optim.Optimizer, step: int, history: list[dict],
                    config: TrainConfig) -> None:
    """checkpoint.pt and optimizer.pt of `step`, each whole or as it was (a run killed while writing)."""
    for name, state in ((OPTIMIZER, {"optimizer": optimizer.state_dict(), "step": step}),
                        (CHECKPOINT, {"head": head.state_dict(), "step": step, "history": history,
                                      "config": dataclasses.asdict(config)})):
        torch.save(state, out / f"{name}.partial")
        os.replace(out / f"{name}.partial", out / name)


def with_ce_weight(config: TrainConfig, state: dict | None, source: Path | None = None) -> TrainConfig:
    """`config` with its cross-entropy weight decided: as asked, else the checkpoint's it goes on from
    (`state`, written at `source`), else CE_WEIGHT; a change from the checkpoint's is said."""
    theirs = None if state is None else state["config"].get("ce_weight", CE_WEIGHT)
    weight = config.ce_weight if config.ce_weight is not None else CE_WEIGHT if theirs is None else theirs
    if theirs is not None and weight != theirs:
        print(f"quickdraft: the cross-entropy weighs {weight} from here on ({source}'s steps: {theirs})",
              file=sys.stderr)
    return dataclasses.replace(config, ce_weight=weight)


def grown_from(head: DraftHead, state: dict, config: TrainConfig, path: Path) -> None:
    """Load into a head that fuses layers the checkpoint `state` (at `path`) of a head that read the
    last layer alone, trained with otherwise the same settings; its fuse starts as the last layer's
    copy (DraftHead.fuse_from_top), so it drafts as that head did and learns what the others add."""
    if head.fuse is None or state["config"].get("feature_layers"):
        raise ValueError(f"--init-from starts a head that fuses layers from one that read the last layer alone; "
                         f"{path} and this run are not that")
    ours = {k: v for k, v in _resumable(dataclasses.asdict(config)).items() if k != "feature_layers"}
    theirs = {k: v for k, v in _resumable(state["config"]).items() if k != "feature_layers"}
    if ours != theirs:
        raise ValueError(f"{path} was written with other settings ({state['config']})")
    missing, unexpected = head.load_state_dict(state["head"], strict=False)
    if missing != ["fuse.weight"] or unexpected:
        raise ValueError(f"{path} does not hold a head of this target's shape")
    head.fuse_from_top()


def grown_moments(optimizer: torch.optim.Optimizer, head: DraftHead, kept: dict) -> None:
    """Load into the optimizer of a grown head (grown_from) the source run's optimizer state `kept`
    (optimizer.pt's), each of its weights' moments onto the same weight: only the fuse's start
    afresh. (With all of them afresh, Adam's first updates move every trained weight by about the
    learning rate, and the grown head fell 0.015 top-1 behind the source run's continuation for
    its first 200 steps: docs/notes/smollm2.md.)"""
    names = [name for name, _ in head.named_parameters()]
    source = [name for name in names if not name.startswith("fuse.")]  # the source head's order
    ours = optimizer.state_dict()
    state = {names.index(name): kept["state"][i] for i, name in enumerate(source) if i in kept["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": ours["param_groups"]})


def train_head(target: Transformer, examples: Sequence[Example], config: TrainConfig, out: Path,
               target_name: str, progress: bool = True, init: Path | None = None) -> dict:
    """Train (or resume training) a head for `target` on `examples`; writes DIR/head.safetensors,
    DIR/head.json and DIR/checkpoint.pt. Returns the training record saved in head.json. `init`: a
    checkpoint of a head that read the last layer alone, which a new run that fuses layers starts
    from (its step and history go on; the optimizer's moments too where the optimizer.pt beside it
    is of that step)."""
    examples = usable_examples(examples, config)
    width = max(1, len(config.feature_layers)) * target.config.hidden_size
    if {e.features.shape[-1] for e in examples} != {width}:
        raise ValueError(f"the examples' features are not the {width} columns a head reading layers "
                         f"{list(config.feature_layers) or 'last'} takes (the target kept other layers)")
    out.mkdir(parents=True, exist_ok=True)
    head, optimizer = new_head(target, examples, config)
    step, history = 0, []
    checkpoint = out / CHECKPOINT
    if init is not None and not checkpoint.is_file():
        state = torch.load(init, map_location=target.device, weights_only=False)
        grown_from(head, state, config, init)
        config = with_ce_weight(config, state, init)
        step, history = state["step"], state["history"]
        moments = init.parent / OPTIMIZER
        kept = torch.load(moments, map_location=target.device, weights_only=False) if moments.is_file() else None
        if kept is not None and kept["step"] == step:
            grown_moments(optimizer, head, kept["optimizer"])
        print(f"quickdraft: starting at step {step} from {init}, the fuse passing the last layer's output "
              f"({'its optimizer moments kept' if kept is not None and kept['step'] == step else 'moments afresh'})",
              file=sys.stderr)
    elif checkpoint.is_file():
        state = torch.load(checkpoint, map_location=target.device, weights_only=False)
        if _resumable(state["config"]) != _resumable(dataclasses.asdict(config)):
            raise ValueError(f"{checkpoint} was written with other settings ({state['config']}); use another "
                             f"--out or delete it")
        head.load_state_dict(state["head"])
        config = with_ce_weight(config, state, checkpoint)
        step, history = state["step"], state["history"]
        moments = out / OPTIMIZER
        kept = torch.load(moments, map_location=target.device, weights_only=False) if moments.is_file() else None
        if kept is not None and kept["step"] == step:
            optimizer.load_state_dict(kept["optimizer"])
        else:
            found = "missing" if kept is None else f"of step {kept['step']}"
            print(f"quickdraft: resuming at step {step} with the optimizer's moments afresh ({moments} is {found})",
                  file=sys.stderr)
    else:
        config = with_ce_weight(config, None)
    bar = tqdm(total=config.steps, initial=step, desc="train-head", unit="step", disable=not progress,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]")
    for entry in train_steps(target, head, optimizer, examples, config, step):
        step = entry["step"]
        history.append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", top1=f"{entry['top1']:.2f}",
                        **{k: f"{v:.2f}" for k, v in entry.items() if k.startswith("top1_")})
        if step % config.checkpoint_every == 0 or step == config.steps:
            save_checkpoint(out, head, optimizer, step, history, config)
    bar.close()
    dtype = str(training_dtype(config.dtype, target.device)).removeprefix("torch.")
    record = {"config": dataclasses.asdict(config), "dtype": dtype,
              "examples": len(examples), "steps": step, "final": history[-1] if history else {}}
    save_head(head.requires_grad_(False).eval(), target, out, target_name, training=record)
    (out / "history.json").write_text(json.dumps(history))
    return {**record, "history": history}


def step_rate(target: Transformer, examples: Sequence[Example], config: TrainConfig, steps: int = 20,
              warmup: int = 3) -> tuple[float, list[dict]]:
    """Median steps/s of `steps` training steps after `warmup` ones, as train_head runs them from
    scratch (nothing written), and the history entries of all of them."""
    if config.steps < warmup + steps:
        raise ValueError(f"config.steps must be >= warmup + steps = {warmup + steps}, found {config.steps}")
    examples = usable_examples(examples, config)
    head, optimizer = new_head(target, examples, config)
    history = list(itertools.islice(train_steps(target, head, optimizer, examples, config), warmup + steps))
    return 1 / statistics.median(h["seconds"] for h in history[warmup:]), history


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
