"""Command line: `quickdraft generate`, `quickdraft serve`, `quickdraft bench ...`.

Turns flags into configs and a loaded model, and token chunks into terminal text. User errors
(QuickdraftError) print one line and exit non-zero, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from quickdraft.cli.bench import (
    add_bench_forward_cost,
    add_bench_head,
    add_bench_plain,
    add_bench_quality,
    add_bench_serve,
)
from quickdraft.cli.bench_specbench import add_bench_specbench
from quickdraft.cli.common import add_model_args, add_sampling_args, add_spec_args
from quickdraft.cli.generate import cmd_generate
from quickdraft.cli.multiturn import add_bench_multiturn
from quickdraft.cli.random_gguf import add_bench_random_gguf
from quickdraft.cli.serve import add_serve
from quickdraft.cli.soak import add_bench_soak
from quickdraft.cli.stall import add_bench_stall
from quickdraft.cli.train import add_build_datastore, add_train_head
from quickdraft.errors import QuickdraftError


class _Version(argparse.Action):
    """--version: the package version and the kernel that runs (building it first if needed)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        info = runtime_info()
        print(f"quickdraft {info['version']} (kernel: {info['kernel']['isa'] or 'none, torch path'}; "
              f"torch {info['torch']})")
        parser.exit()


def runtime_info() -> dict:
    import platform

    import torch

    from quickdraft import __version__, kernels
    return {"version": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "kernel": kernels.kernel_info().as_dict()}


def cmd_info(args: argparse.Namespace) -> int:
    import json
    info = runtime_info()
    if args.json:
        print(json.dumps(info))
        return 0
    k = info["kernel"]
    print(f"quickdraft {info['version']}, torch {info['torch']}, Python {info['python']}\n"
          f"CPU capability (torch): {info['cpu_capability']}, {info['threads']} threads\n"
          f"kernel: {k['isa'] or 'none (torch path)'}: {k['status']}" + (f"\n  {k['path']}" if k["path"] else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description="Fast, exact speculative decoding.")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and active kernel, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = sub.add_parser("info", help="version, instruction set and the CPU kernel that runs")
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=cmd_info)

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
    gen.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    gen.set_defaults(func=cmd_generate)

    add_serve(sub)
    add_train_head(sub)
    add_build_datastore(sub)

    bench = sub.add_parser("bench", help="benchmarks (speed ratios measured side by side)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    add_bench_plain(bsub)
    add_bench_specbench(bsub)
    add_bench_forward_cost(bsub)
    add_bench_serve(bsub)
    add_bench_quality(bsub)
    add_bench_head(bsub)
    add_bench_random_gguf(bsub)
    add_bench_soak(bsub)
    add_bench_stall(bsub)
    add_bench_multiturn(bsub)
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
