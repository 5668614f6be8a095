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


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise QuickdraftError(f"--threads must be >= 1, found {threads}")
        import torch
        torch.set_num_threads(threads)


def cmd_bench_forward_cost(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quickdraft.bench.forward_cost import default_q_values, run_forward_cost
    if args.max_q < 1 or args.repeats < 1 or args.context < 1:
        raise QuickdraftError(f"--max-q, --repeats and --context must be >= 1, found "
                              f"{args.max_q}, {args.repeats}, {args.context}")
    q_values = list(range(1, args.max_q + 1)) if args.all_q else default_q_values(args.max_q)
    _set_threads(args.threads)
    try:
        run_forward_cost(args.model, args.device, args.dtype, q_values, args.context, args.repeats,
                         Path(args.out) if args.out else None)
    except ValueError as e:  # context + q past the model's positions
        raise QuickdraftError(str(e)) from None
    return 0


def _specbench_command(args: argparse.Namespace) -> str:
    """The run's effective options as one command line (defaults spelled out), for the report."""
    import shlex
    words = ["quickdraft", "bench", "specbench", "--model", args.model, "--device", args.device,
             "--dtype", args.dtype, "--methods", args.methods, "-k", str(args.k),
             "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature)]
    for flag, value in (("--questions", args.questions), ("--groups", args.groups), ("--limit", args.limit),
                        ("--seed", args.seed), ("--ngram-max", args.ngram_max), ("--ngram-min", args.ngram_min),
                        ("--threads", args.threads), ("--out", args.out)):
        if value is not None:
            words += [flag, str(value)]
    if args.compare_hf:
        words += ["--compare-hf", "--hf-lookup-tokens", str(args.hf_lookup_tokens)]
    return shlex.join(words)


def cmd_bench_specbench(args: argparse.Namespace) -> int:
    import platform
    import time
    from pathlib import Path

    import torch

    from quickdraft.bench.questions import load_questions, parse_groups, resolve_questions_path, select_questions
    from quickdraft.bench.report import build_results, markdown_report, write_outputs
    from quickdraft.bench.specbench import parse_methods, run_specbench
    path = resolve_questions_path(args.questions)  # every check before the slow load
    questions = select_questions(load_questions(path), parse_groups(args.groups), args.limit)
    methods = parse_methods(args.methods, args.k, args.ngram_max, args.ngram_min, args.compare_hf)
    _set_threads(args.threads)
    llm, records = run_specbench(args.model, questions, methods, args.max_new_tokens, args.temperature,
                                 args.seed, args.device, args.dtype, args.hf_lookup_tokens,
                                 progress=not args.no_progress)
    config = {"model": args.model, "model_file": str(llm.loaded.source.path), "device": args.device,
              "dtype": args.dtype, "questions": str(path), "groups": parse_groups(args.groups),
              "limit": args.limit, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "seed": args.seed, "k": args.k, "hf_lookup_tokens": args.hf_lookup_tokens,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.machine(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": _specbench_command(args)}
    results = build_results(config, [m.describe() for m in methods], records)
    print(markdown_report(results), end="")
    if args.out:
        written = write_outputs(results, Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 1 if results["failures"] else 0


def add_bench_specbench(bsub) -> None:
    sb = bsub.add_parser("specbench", help="Spec-Bench questions: speedup of each method over plain decoding")
    add_model_args(sb)
    sb.add_argument("--questions", help="questions.jsonl (default: ../shared/data/specbench/questions.jsonl "
                                        "beside the repository, when present)")
    sb.add_argument("--methods", default="plain,ngram",
                    help="comma-separated: plain (always run, the baseline), a proposer name (ngram, ...), "
                         "NAME:K for its own k, draft:PATH[:K] (default: plain,ngram)")
    sb.add_argument("--groups", help="comma-separated task groups (default: all six: mt_bench, translation, "
                                     "summarization, qa, math_reasoning, rag)")
    sb.add_argument("--limit", type=int, help="questions per group (default: all)")
    sb.add_argument("--max-new-tokens", "-n", type=int, default=128, help="per turn (default 128)")
    sb.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    sb.add_argument("--seed", type=int, default=None, help="sampling seed (question i uses seed + i)")
    sb.add_argument("-k", type=int, default=4, help="draft tokens per step unless NAME:K says (default 4)")
    sb.add_argument("--ngram-max", type=int, help="n-gram proposer: longest suffix matched (default: SpecConfig's)")
    sb.add_argument("--ngram-min", type=int, help="n-gram proposer: shortest suffix matched (default: SpecConfig's)")
    sb.add_argument("--compare-hf", action="store_true",
                    help="add transformers' generate (hf-plain) and its prompt lookup (hf-prompt-lookup) rows")
    sb.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    sb.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sb.add_argument("--out", help="folder for results.json, report.md and speedup.png")
    sb.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sb.set_defaults(func=cmd_bench_specbench)


def add_bench_forward_cost(bsub) -> None:
    fc = bsub.add_parser("forward-cost", help="t(q)/t(1): one target pass feeding q tokens over a cached context")
    add_model_args(fc)
    fc.add_argument("--max-q", type=int, default=64, help="largest q measured (default 64)")
    fc.add_argument("--all-q", action="store_true", help="every q in 1..max-q (default: a spread of q)")
    fc.add_argument("--context", type=int, default=256, help="cached context length (default 256)")
    fc.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians reported (default 5)")
    fc.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    fc.add_argument("--out", help="folder for forward_cost.json and forward_cost.png")
    fc.set_defaults(func=cmd_bench_forward_cost)


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
    add_bench_specbench(bsub)
    add_bench_forward_cost(bsub)
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
