"""Draft-head training steps per second on this machine, in float32 and in bfloat16 (trainer.step_rate:
the steps train_head runs, from scratch, median after a warm-up), for the figures in
docs/proposers.md, "Training a draft head".

The batch is `--batch-size` examples of `--max-len` random tokens (seeded) with random features of the
target's width in place of its own, the prompt the first quarter of each: a step's cost depends on
the shapes only. Usage: `python scripts/train_speed.py --threads 1` (SmolLM2-135M as packaged).
"""
from __future__ import annotations

import argparse
import platform

import torch

import quickdraft
from quickdraft.bench.multiturn_report import cpu_name
from quickdraft.kernels.build import cpu_flags
from quickdraft.train.features import STORE_DTYPE, Example
from quickdraft.train.trainer import BF16_FLAGS, TrainConfig, step_rate


def random_batch(vocab_size: int, hidden_size: int, batch_size: int, length: int) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [Example(torch.randint(vocab_size, (length + 1,), generator=g).tolist(),
                    torch.randn(length, hidden_size, generator=g).to(STORE_DTYPE), length // 4)
            for _ in range(batch_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after 3 untimed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = quickdraft.load(args.model).model
    batch = random_batch(target.config.vocab_size, target.config.hidden_size, args.batch_size, args.max_len)
    flags = sorted(set(BF16_FLAGS) & (cpu_flags() or set()))
    print(f"{cpu_name()} ({platform.machine()}), bfloat16 flags: {', '.join(flags) or 'none'}; torch "
          f"{torch.__version__}, {args.threads} thread(s); {args.model} ({target.weight_format}), "
          f"{args.batch_size} x {args.max_len} tokens per step")
    for dtype in ("float32", "bfloat16"):
        config = TrainConfig(steps=args.steps + 3, batch_size=args.batch_size, max_len=args.max_len, dtype=dtype)
        rate, _ = step_rate(target, batch, config, steps=args.steps, warmup=3)
        print(f"{dtype}: {rate:.3f} steps/s ({1 / rate:.2f} s/step)", flush=True)


if __name__ == "__main__":
    main()
