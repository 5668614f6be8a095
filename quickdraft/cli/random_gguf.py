"""`quickdraft bench random-gguf`: a random-weight GGUF of an MoE model's shape (quickdraft/bench/random_gguf.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quickdraft.errors import QuickdraftError


def cmd_bench_random_gguf(args: argparse.Namespace) -> int:
    import dataclasses
    import shlex

    from quickdraft.bench.random_gguf import SHAPES, write_random_moe
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    if not 1 <= layers <= shape.layers:
        raise QuickdraftError(f"--layers must be in 1..{shape.layers} for {args.shape}, found {layers}")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise QuickdraftError(f"{out} exists; pass --force to write over it")
    shape = dataclasses.replace(shape, layers=layers)
    command = shlex.join(["quickdraft", "bench", "random-gguf", "--shape", args.shape, "--layers", str(layers),
                          "--out", str(out)])
    print(f"`{command}`: {args.shape}'s shape with {layers} of {SHAPES[args.shape].layers} layers, random blocks",
          file=sys.stderr)
    write_random_moe(shape, out, args.seed, progress=lambda line: print(line, file=sys.stderr))
    print(out)
    return 0


def add_bench_random_gguf(bsub) -> None:
    from quickdraft.bench.random_gguf import SHAPES  # numpy and gguf only
    rg = bsub.add_parser("random-gguf", help="write a random-weight GGUF of a mixture-of-experts model's shape in its "
                                             "published files' block types (Qwen3-30B-A3B: Q4_K_M; gpt-oss-20b: MXFP4 "
                                             "experts, Q8_0) for speed against llama.cpp on the same file")
    rg.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="the model whose shape it takes")
    rg.add_argument("--layers", type=int, help="layers written (default: the model's; fewer for less disk and time)")
    rg.add_argument("--out", required=True, help="the .gguf file to write")
    rg.add_argument("--seed", type=int, default=0)
    rg.add_argument("--force", action="store_true", help="write over an existing file")
    rg.set_defaults(func=cmd_bench_random_gguf)
