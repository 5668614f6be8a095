"""Offline A/B of issue 47 item 2 (EAGLE-3's fused features), the instrument of the 2026-11-30 note
in docs/notes/smollm2.md: a draft head reading the target's top layer (as the engine's heads do)
against one reading its low, middle and top layers' outputs through a learned fuse (3D -> D); both
from the same seed on the same responses and steps, with the trainer's loss and schedule, then
top-1 agreement with the target on held-out responses' own features (passes 1-3 unrolled, as
`train-head` reports). SmolLM2, the run's saved responses (training/smollm2-135m): the first
N_TRAIN for training, 5,000-5,159 held out. Not part of the package: once `train-head` can fuse
layers, its runs replace this. Run from the repository root:

    python scripts/fusion_ab.py 800 600
"""
import gzip
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(2)
import quickdraft
from quickdraft.proposers.head import DraftHead, head_config
from quickdraft.train.features import Example
from quickdraft.train.trainer import (
    LogSumExp,
    TrainConfig,
    batch_of,
    draft_vocabulary,
    loss_positions,
    lr_at,
    training_dtype,
)

N_TRAIN, STEPS = int(sys.argv[1]), int(sys.argv[2])
HELD = range(5000, 5160)
target = quickdraft.load("smollm2-135m").model
L, D = target.config.num_layers, target.config.hidden_size
TAPS = (2, L // 2, L - 1)
saved = json.loads(gzip.decompress(Path("training/smollm2-135m/responses.json.gz").read_bytes()))["responses"]
captured = {}
for i in TAPS:
    target.blocks[i].register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))

@torch.inference_mode()
def feats(tokens):
    ids = torch.tensor([tokens[:-1]])
    target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, ids.shape[1]), last_n=0)
    return torch.cat([captured[i][0] for i in TAPS], -1).to(torch.bfloat16)  # [n, 3D]: low | mid | top

t0 = time.time()
def examples(indices):
    return [Example(saved[i]["tokens"], feats(saved[i]["tokens"]), saved[i]["prompt_len"]) for i in indices]
train, held = examples(range(N_TRAIN)), examples(HELD)
print(f"features {time.time() - t0:.0f} s", flush=True)

class Head(DraftHead):
    def __init__(self, config, vocab, fused):
        super().__init__(config, vocab)
        self.fuse = nn.Linear(3 * D, D, bias=False) if fused else None
    def read(self, f):  # the target's taps [.., 3D] -> the head's input feature [.., D]
        return self.fuse(f) if self.fuse is not None else f[..., -D:]

def loss(head, batch, config, train_mode=True):
    n = max(len(e.features) for e in batch)
    feats_ = torch.zeros(len(batch), n, 3 * D)
    tokens = torch.zeros(len(batch), n + 1, dtype=torch.long)
    for b, e in enumerate(batch):
        feats_[b, :len(e.features)] = e.features.float()
        tokens[b, :len(e.tokens)] = torch.tensor(e.tokens)
    valid = loss_positions(batch, n - 1)
    positions = torch.arange(n - 1).expand(len(batch), n - 1)
    gain, eps = target.norm.weight.float(), target.norm.eps
    with torch.no_grad():
        embeds = target.embed(tokens[:, 1:n]).float()
        lm_weight = LM
        goal = feats_[:, 1:, -D:][valid]
        goal_normed = gain * F.rms_norm(goal, (D,), eps=eps)
        p = torch.softmax(F.linear(goal_normed, lm_weight).float(), -1)
        best = p.argmax(-1)
        p_weight = (p @ lm_weight).float()
    inputs, total, parts = head.read(feats_[:, :-1]), 0, {}
    for j in range(config.unroll):
        predicted = head(inputs, embeds, positions, head.new_cache(n - 1, torch.device("cpu"), torch.float32, len(batch)))
        normed = gain * F.rms_norm(predicted[valid].float(), (D,), eps=eps)
        regression = F.smooth_l1_loss(normed, goal_normed)
        log_total, mine = LogSumExp.apply(F.linear(normed, lm_weight))
        ce = (log_total - (normed * p_weight).sum(-1)).mean()
        total = total + config.unroll_decay ** j * (regression + config.ce_weight * ce)
        parts[f"top1_{j + 1}"] = ((mine == best).float().sum().item(), len(best))
        # the next pass reads at position t this pass's prediction (position 0: the target's, fused)
        inputs = torch.cat([head.read(feats_[:, :1]), predicted[:, :-1].detach()], 1)
    return total, parts

config = TrainConfig(steps=STEPS, checkpoint_every=STEPS)
vocab = draft_vocabulary(train, target.config.vocab_size, config.draft_vocab)
from quickdraft.kernels import QuantizedWeight

w = target.lm_head.weight
LM = (w.dequantize() if isinstance(w, QuantizedWeight) else w).float()[vocab]
dtype = training_dtype("auto", torch.device("cpu"))
results = {}
for fused in (False, True):
    torch.manual_seed(0)
    head = Head(head_config(target.config), vocab, fused).float().train()
    head.inv_freq = head.inv_freq.float()
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, config)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            total, parts = loss(head, batch_of(train, step, config), config)
        opt.zero_grad(set_to_none=True); total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0); opt.step()
        if (step + 1) % 100 == 0:
            print(f"fused={fused} step {step + 1} train top1 {parts['top1_1'][0] / parts['top1_1'][1]:.3f} {time.time() - t0:.0f} s", flush=True)
    head.eval()
    sums = {}
    with torch.no_grad():
        for i in range(0, len(held), 8):
            _, parts = loss(head, held[i:i + 8], config)
            for k, (a, b) in parts.items():
                s = sums.setdefault(k, [0, 0]); s[0] += a; s[1] += b
    results[fused] = {k: round(a / b, 4) for k, (a, b) in sums.items()}
    print(f"fused={fused} held-out {results[fused]} ({sums['top1_1'][1]} positions)", flush=True)
print(json.dumps({"n_train": N_TRAIN, "steps": STEPS, "taps": TAPS, "results": {str(k): v for k, v in results.items()}}))
