"""`quickdraft train-head`: ShareGPT conversations -> a draft head for the target, with progress,
checkpoints and resume; reports the head's acceptance on held-out conversations at the end."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from quickdraft.cli.common import add_model_args, set_threads
from quickdraft.errors import QuickdraftError

HELD_OUT = 8  # conversations after the training ones, for the acceptance report


def cmd_train_head(args: argparse.Namespace) -> int:
    from quickdraft.api import load
    from quickdraft.bench.questions import default_questions_path, load_questions
    from quickdraft.train.data import iter_sharegpt, sharegpt_path, token_sequences, without_benchmark
    from quickdraft.train.trainer import TrainConfig, acceptance, train_head
    from quickdraft.spec.head import load_head

    try:
        config = TrainConfig(steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
                             checkpoint_every=args.checkpoint_every, seed=args.seed)
    except ValueError as e:
        raise QuickdraftError(str(e)) from None
    if args.conversations < 1:
        raise QuickdraftError(f"--conversations must be >= 1, found {args.conversations}")
    data = sharegpt_path()
    set_threads(args.threads)
    llm = load(args.model, device=args.device, dtype=args.dtype, progress=not args.no_progress)
    questions = default_questions_path()
    banned = {t for q in load_questions(questions) for t in q.turns} if questions else set()
    print(f"quickdraft: {len(banned)} Spec-Bench turns excluded from training"
          f"{'' if questions else ' (no Spec-Bench file found)'}", file=sys.stderr)
    conversations = without_benchmark(iter_sharegpt(data), banned)
    sequences = list(itertools.islice(token_sequences(conversations, llm.tokenizer, args.max_len),
                                      args.conversations + HELD_OUT))
    held_out, train = sequences[args.conversations:], sequences[:args.conversations]
    print(f"quickdraft: {len(train)} training sequences ({sum(map(len, train))} tokens) from {data.name}",
          file=sys.stderr)
    out = Path(args.out)
    try:
        train_head(llm.model, train, config, out, args.model, progress=not args.no_progress)
    except ValueError as e:
        raise QuickdraftError(str(e)) from None
    head = load_head(out, llm.model)
    prompts = [s[:min(len(s) // 2, 128)] for s in held_out if len(s) >= 32]
    if prompts:
        rate, per_pass = acceptance(llm.model, head, prompts, k=4)
        print(f"quickdraft: held-out acceptance {rate:.0%}, {per_pass:.2f} tokens per target pass "
              f"(greedy, up to k=4, {len(prompts)} prompts)", file=sys.stderr)
    print(f"quickdraft: head written to {out}", file=sys.stderr)
    return 0


def add_train_head(sub) -> None:
    tr = sub.add_parser("train-head", help="train an EAGLE-style draft head for a target on ShareGPT")
    add_model_args(tr)
    tr.add_argument("--out", required=True, help="folder for head.safetensors, head.json and checkpoints")
    tr.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to train on")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    tr.add_argument("--max-len", type=int, default=256, help="tokens per sequence at most")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=cmd_train_head)
