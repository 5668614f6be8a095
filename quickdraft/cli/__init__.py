"""Command line: `quickdraft generate`, `quickdraft serve`, `quickdraft bench ...`.

Turns flags into configs and a loaded model, and token chunks into terminal text. User errors
(QuickdraftError) print one line and exit non-zero, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from quickdraft.cli.bench import add_bench_forward_cost, add_bench_plain, add_bench_serve, add_bench_specbench
from quickdraft.cli.common import add_model_args, add_sampling_args, add_spec_args
from quickdraft.cli.generate import cmd_generate
from quickdraft.cli.serve import add_serve
from quickdraft.cli.train import add_train_head
from quickdraft.errors import QuickdraftError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description="Fast, exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt or chat message")
    add_model_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="raw prompt text (no chat template)")
    src.add_argument("--chat", "-c", help="a user message, formatted with the model's chat template")
    gen.add_argument("--system", help="system message for --chat")
    add_sampling_args(gen)
    add_spec_args(gen)
    gen.add_argument("--compare", action="store_true",
                     help="run plain decoding first on the same prompt; print the speedup and whether "
                          "the outputs are identical")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)

    add_serve(sub)
    add_train_head(sub)

    bench = sub.add_parser("bench", help="benchmarks (speed ratios measured side by side)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    add_bench_plain(bsub)
    add_bench_specbench(bsub)
    add_bench_forward_cost(bsub)
    add_bench_serve(bsub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except QuickdraftError as e:
        print(f"quickdraft: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nquickdraft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
