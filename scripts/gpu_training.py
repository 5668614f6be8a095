"""The training half of the GPU check (gpu_check.py): `train-head`'s steps on the device. A tiny
target fusing two layers' features on the device: the features prefill rebuilds, a run in the
matmul dtype `auto` picks there (bfloat16 on a GPU that multiplies it natively) whose loss falls and
whose head is then accepted more often than an untrained one, and a run killed after a checkpoint
that resumes where the whole run went (float32; on CUDA not bitwise: the embedding's backward adds
atomically, so the losses are compared to a tolerance and the largest gap is recorded).
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

Case = Callable[[Any, str, dict[str, Any], Callable[[], dict[str, Any]]], None]
LAYERS = (0, 1)  # the tiny models' two layers, fused as EAGLE-3 fuses a target's low, middle and top layers


def mean(values: Any) -> float:
    return statistics.fmean(values)


def run(report: Any, device: str, tmp: Path, case: Case) -> None:
    """`case(report, section, fields, check)` records each (gpu_check.case)."""
    from quickdraft.proposers.head import load_head
    from quickdraft.train import trainer
    from quickdraft.train.features import FEATURES, training_examples
    from quickdraft.train.responses import RESPONSES, generate_responses
    from quickdraft.train.trainer import CE_WEIGHT, TrainConfig, acceptance, train_head, training_dtype
    from support.models import tiny

    model = tiny("llama-gqa-untied", init=0.1, device=device)
    model.keep_features(LAYERS)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(56)]
    answers = generate_responses(model, prompts, frozenset(), 40, tmp / "train" / RESPONSES, batch_size=8,
                                 progress=False)
    examples = training_examples(model, answers[:48], tmp / "train" / FEATURES, progress=False)
    held_out = [r.tokens[:r.prompt_len + 2] for r in answers[48:]]
    config = TrainConfig(steps=80, batch_size=8, max_len=48, lr=3e-3, warmup=5, checkpoint_every=40, dtype="auto",
                         ce_weight=CE_WEIGHT, feature_layers=LAYERS)
    dtype = str(training_dtype("auto", model.device)).removeprefix("torch.")

    def learns() -> dict[str, Any]:
        record = train_head(model, examples, config, tmp / "head", "tiny", progress=False)
        history = record["history"]
        first, last = history[:10], history[-10:]
        untrained = trainer.new_head(model, examples, config)[0].requires_grad_(False).eval()
        before, _ = acceptance(model, untrained, held_out)
        after, per_pass = acceptance(model, load_head(tmp / "head", model), held_out)
        fell = mean(h["loss"] for h in last) < 0.85 * mean(h["loss"] for h in first)
        rose = mean(h["top1"] for h in last) > mean(h["top1"] for h in first) + 0.1
        native = device != "cuda" or record["dtype"] == "bfloat16"  # an H100/H200 multiplies bfloat16
        return {"ok": fell and rose and after > before + 0.05 and native, "dtype": record["dtype"],
                "loss": [round(mean(h["loss"] for h in part), 3) for part in (first, last)],
                "top1": [round(mean(h["top1"] for h in part), 3) for part in (first, last)],
                "acceptance": [round(before, 3), round(after, 3)], "tokens_per_pass": round(per_pass, 3),
                "steps_per_s": round(1 / statistics.median(h["seconds"] for h in history[5:]), 1)}

    case(report, "training", {"case": "fused layers, loss and acceptance", "dtype_auto": dtype}, learns)

    def resumes() -> dict[str, Any]:
        f32 = dataclasses.replace(config, dtype="float32")
        whole = train_head(model, examples, f32, tmp / "whole", "tiny", progress=False)["history"]
        real, calls = trainer.head_loss, []

        def dies_at_step_41(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 40 * f32.length_groups + 1:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        trainer.head_loss = dies_at_step_41
        try:
            train_head(model, examples, f32, tmp / "killed", "tiny", progress=False)
        except KeyboardInterrupt:
            pass
        finally:
            trainer.head_loss = real
        resumed = train_head(model, examples, f32, tmp / "killed", "tiny", progress=False)["history"]
        gap = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(resumed, whole))
        return {"ok": len(calls) > 40 and len(resumed) == len(whole) and gap < 1e-3, "max_rel_gap": gap}

    case(report, "training", {"case": "killed at step 41, resumed"}, resumes)
