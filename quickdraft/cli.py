"""Command line: `quickdraft generate`, `quickdraft bench ...`.

Turns flags into SamplingParams and a loaded model, and token chunks into terminal text.
User errors (QuickdraftError) print one line and exit non-zero, without a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from quickdraft.api import DTYPES, load
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.weights.resolve import DEFAULT_MODEL


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"packaged name, HF model directory or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights and activations")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens whatever the model says")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)  # validate before the slow load
    if args.prompt is None and args.chat is None:
        raise QuickdraftError("give a prompt: --prompt TEXT (raw) or --chat MESSAGE (chat template)")
    progress = sys.stderr.isatty() and not args.json
    llm = load(args.model, device=args.device, dtype=args.dtype, progress=progress)
    messages = None
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.chat}]
    chunks, ids = [], []
    for chunk in llm.stream(args.prompt, messages, params):
        chunks.append(chunk.text)
        ids.extend(chunk.token_ids)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    stats = chunk.stats
    if args.json:
        print(json.dumps({"text": "".join(chunks), "token_ids": ids, "prompt_tokens": stats.prompt_tokens,
                          "new_tokens": stats.new_tokens, "ttft_s": stats.ttft_s,
                          "tokens_per_s": stats.tokens_per_s, "finish_reason": chunk.finish_reason}))
    else:
        print()
        print(f"[prompt {stats.prompt_tokens} tokens | new {stats.new_tokens} tokens | "
              f"ttft {stats.ttft_s * 1000:.0f} ms | {stats.tokens_per_s:.1f} tokens/s | "
              f"finish: {chunk.finish_reason}]", file=sys.stderr)
    return 0


def cmd_bench_plain(args: argparse.Namespace) -> int:
    from quickdraft.bench.plain import run_plain_bench
    run_plain_bench(args.model, [d.strip() for d in args.dtypes.split(",")], args.prompts,
                    args.max_new_tokens, args.repeats, args.device)
    return 0


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
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks (speed ratios measured side by side)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    plain = bsub.add_parser("plain", help="plain greedy decoding: quickdraft vs transformers' generate")
    plain.add_argument("--model", "-m", default=DEFAULT_MODEL)
    plain.add_argument("--device", default="cpu")
    plain.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    plain.add_argument("--prompts", type=int, default=4, help="number of built-in prompts (1-8)")
    plain.add_argument("--max-new-tokens", "-n", type=int, default=64)
    plain.add_argument("--repeats", type=int, default=2, help="interleaved rounds per prompt")
    plain.set_defaults(func=cmd_bench_plain)
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
