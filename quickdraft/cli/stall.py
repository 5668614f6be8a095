"""`quickdraft bench stall`: a running stream's gaps between tokens while a long prompt is prefilled,
against its gaps before (quickdraft/bench/stall.py does the work)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

from quickdraft.cli.common import add_model_args, load_llm
from quickdraft.engine.service import loaded_objects_frozen
from quickdraft.engine.startup import set_threads
from quickdraft.errors import QuickdraftError


def cmd_bench_stall(args: argparse.Namespace) -> int:
    from quickdraft.bench.stall import long_prompt, measure_round
    if min(args.prompt_tokens, args.rounds, args.stream_tokens) < 1:
        raise QuickdraftError("--prompt-tokens, --stream-tokens and --rounds must be >= 1")
    set_threads(args.threads)
    llm = load_llm(args, progress=sys.stderr.isatty())
    context = llm.model.config.max_position_embeddings
    if args.prompt_tokens + 1 > context:
        raise QuickdraftError(f"--prompt-tokens {args.prompt_tokens} does not fit the model's context of {context}")
    stream_ids = long_prompt(llm, args.stream_tokens, salt=0)
    rounds = []
    with loaded_objects_frozen():  # as a server's loop runs
        for r in range(args.rounds):
            rounds.append(measure_round(llm, stream_ids, long_prompt(llm, args.prompt_tokens, salt=r + 1)))
            print(f"[stall] round {r + 1}: usual gap {rounds[-1].usual_gap_s * 1e3:.1f} ms, worst during the "
                  f"prefill {rounds[-1].worst:.2f}x, prefill {rounds[-1].prefill_s:.2f} s", file=sys.stderr)
    result = {"model": args.model, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "prompt_tokens": args.prompt_tokens, "rounds": [r.to_dict() for r in rounds],
              "worst_ratio": max(r.worst for r in rounds),
              "median_worst_ratio": statistics.median(r.worst for r in rounds)}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"| round | usual gap (ms) | gaps during the prefill | median (ms) | worst (ms) | worst / usual | "
          f"prefill of {args.prompt_tokens} tokens (s) |\n|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r.usual_gap_s * 1e3:.1f} | {len(r.gaps_s)} | {statistics.median(r.gaps_s) * 1e3:.1f} | "
              f"{max(r.gaps_s) * 1e3:.1f} | {r.worst:.2f}x | {r.prefill_s:.2f} |")
    print(f"\nworst gap during a prefill, in usual gaps: {result['worst_ratio']:.2f}x (median over rounds "
          f"{result['median_worst_ratio']:.2f}x)")
    return 0


def add_bench_stall(bsub) -> None:
    st = bsub.add_parser("stall", help="a running stream's gaps between tokens while a long prompt is prefilled")
    add_model_args(st)
    st.add_argument("--prompt-tokens", type=int, default=4000, help="the long prompt's tokens (default 4000)")
    st.add_argument("--stream-tokens", type=int, default=64, help="the running stream's prompt tokens (default 64)")
    st.add_argument("--rounds", type=int, default=3, help="long prompts, one after another (default 3)")
    st.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    st.add_argument("--json", action="store_true", help="print the JSON object instead of the table")
    st.set_defaults(func=cmd_bench_stall)
