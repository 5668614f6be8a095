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
from quickdraft.engine import GenerationStats
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.spec import PROPOSERS, SpecConfig
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


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="none", choices=["none", *sorted(PROPOSERS)],
                   help="proposer for speculative decoding (default: none = plain decoding)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--draft-model", help="draft model for --spec draft (name, HF directory or .gguf)")
    p.add_argument("--ngram-max", type=int, default=4, help="n-gram proposer: longest suffix matched")
    p.add_argument("--ngram-min", type=int, default=1, help="n-gram proposer: shortest suffix matched")


def spec_from_args(args: argparse.Namespace) -> SpecConfig:
    return SpecConfig(method=args.spec, k=args.k, draft_model=args.draft_model,
                      ngram_max=args.ngram_max, ngram_min=args.ngram_min)


def stats_line(stats: GenerationStats, finish: str | None) -> str:
    line = (f"prompt {stats.prompt_tokens} tokens | new {stats.new_tokens} tokens | "
            f"ttft {stats.ttft_s * 1000:.0f} ms | {stats.tokens_per_s:.1f} tokens/s | "
            f"{stats.target_passes} target passes, {stats.tokens_per_pass:.2f} tokens/pass")
    if stats.drafted_tokens:
        by_pos = " ".join(f"{r:.2f}" for r in stats.acceptance_by_position)
        line += (f" | acceptance {stats.acceptance_rate:.0%} of {stats.drafted_tokens} drafted "
                 f"(by position: {by_pos}) | propose {stats.propose_s:.2f}s verify {stats.verify_s:.2f}s "
                 f"other {stats.other_s:.2f}s")
    return f"[{line} | finish: {finish}]"


def _run(llm, args, params, spec, echo: bool) -> dict:
    messages = None
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.chat}]
    chunks, ids = [], []
    for chunk in llm.stream(args.prompt, messages, params, spec):
        chunks.append(chunk.text)
        ids.extend(chunk.token_ids)
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if echo:
        print()
    stats = chunk.stats
    return {"text": "".join(chunks), "token_ids": ids, "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens, "ttft_s": stats.ttft_s, "tokens_per_s": stats.tokens_per_s,
            "finish_reason": chunk.finish_reason, "stats": stats.to_dict(), "_stats": stats}


def cmd_generate(args: argparse.Namespace) -> int:
    params, spec = sampling_from_args(args), spec_from_args(args)  # validate before the slow load
    if args.prompt is None and args.chat is None:
        raise QuickdraftError("give a prompt: --prompt TEXT (raw) or --chat MESSAGE (chat template)")
    if args.compare and not spec.enabled:
        raise QuickdraftError("--compare needs a proposer: add --spec ngram (or --spec draft --draft-model PATH)")
    progress = sys.stderr.isatty() and not args.json
    llm = load(args.model, device=args.device, dtype=args.dtype, progress=progress, spec=spec)
    plain = _run(llm, args, params, SpecConfig(), echo=False) if args.compare else None
    result = _run(llm, args, params, spec, echo=not args.json)
    if not args.json:
        if plain is not None:
            print(f"plain:       {stats_line(plain['_stats'], plain['finish_reason'])}", file=sys.stderr)
        print(f"{'speculative: ' if plain else ''}{stats_line(result['_stats'], result['finish_reason'])}",
              file=sys.stderr)
    if plain is not None:
        speedup = result["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
        identical = plain["token_ids"] == result["token_ids"]
        if not args.json:
            print(f"speedup {speedup:.2f}x ({spec.method}, k={spec.k}: {result['tokens_per_s']:.1f} vs "
                  f"{plain['tokens_per_s']:.1f} tokens/s); outputs identical: {'yes' if identical else 'no'}"
                  f"{'' if params.greedy else ' (sampling: outputs differ by design)'}", file=sys.stderr)
    if args.json:
        out = {key: value for key, value in result.items() if not key.startswith("_")}
        if plain is not None:
            out.update(plain={key: value for key, value in plain.items() if not key.startswith("_")},
                       speculative={key: value for key, value in result.items() if not key.startswith("_")},
                       speedup=speedup, identical=identical)
        print(json.dumps(out))
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
    add_spec_args(gen)
    gen.add_argument("--compare", action="store_true",
                     help="run plain decoding first on the same prompt; print the speedup and whether "
                          "the outputs are identical")
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
