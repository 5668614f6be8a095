"""`quickdraft bench serve --replicas N,M,...`: bench serve's waves against `quickdraft serve
--replicas N` started in a process of its own per count (quickdraft/bench/serve.py does the work);
the in-process server of plain `bench serve` is cli/bench.py's."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    from quickdraft.bench.questions import Question


def replica_counts(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise QuickdraftError(f"--replicas must be comma-separated integers, found {text!r}") from None
    if min(counts) < 1 or len(set(counts)) < len(counts):
        raise QuickdraftError(f"--replicas must be distinct counts >= 1, found {text!r}")
    return counts


def serve_flags(args: argparse.Namespace, levels: Sequence[int]) -> list[str]:
    """What every `quickdraft serve` of the run is given: the bench's model, engine and speculation,
    no prefix cache (every round resends the same requests)."""
    flags = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--no-prefix-cache",
             "--max-batch", str(max(levels)), "--max-seq-len", str(args.max_seq_len), "--policy", args.policy,
             "--spec", args.spec, "-k", str(args.k)]
    flags += [f for flag, value in (("--quantize", args.quantize), ("--activations", args.activations),
                                    ("--draft-model", args.draft_model), ("--threads", args.threads))
              if value is not None for f in (flag, str(value))]
    flags += ["--dequantize"] if args.dequantize else []
    return flags + (["--no-measure-cost"] if args.spec == "none" else [])


def cmd_bench_serve_replicas(args: argparse.Namespace, levels: list[int], questions: list[Question]) -> int:
    from quickdraft.bench.serve import SERVED_NAME, replicas_report, run_on_replicas, run_serve_bench, started
    counts = replica_counts(args.replicas)
    speculative = None if args.spec == "none" else {"method": args.spec, "k": args.k}
    flags = serve_flags(args, levels)

    def bench(url: str, warmed) -> dict:
        return run_serve_bench(url, SERVED_NAME, questions, levels, args.rounds, args.max_new_tokens, speculative,
                               progress=not args.no_progress, warmed=warmed)

    with tempfile.TemporaryDirectory(prefix="quickdraft-bench-serve-") as tmp:
        log_dir = Path(args.out) / "logs" if args.out else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        results = run_on_replicas(counts, lambda n: started(flags, n, args.router, log_dir), bench)
    command = " ".join(["quickdraft", *sys.argv[1:]])
    results["config"] = {"command": command, "model": args.model, "spec": args.spec, "k": args.k,
                         "threads_per_replica": args.threads, "router": args.router, "replicas": counts,
                         "requests": len(questions), "questions": [q.question_id for q in questions]}
    report = replicas_report(results)
    print(json.dumps(results, indent=1) if args.json else report, end="\n" if args.json else "")
    if args.out:
        out = Path(args.out)
        (out / "serve.json").write_text(json.dumps(results, indent=1))
        (out / "serve.md").write_text(f"`{command}`\n\n{report}")
        print(f"\nwrote {out / 'serve.json'}, {out / 'serve.md'}", file=sys.stderr)
    same = all(r["identical"] == 1.0 for levels_ in results["against_base"].values()
               for modes in levels_.values() for r in modes.values())
    spec_same = all(level.get("identical", 1.0) == 1.0 for run in results["replicas"].values()
                    for level in run["levels"].values())
    if not (same and spec_same):
        print("quickdraft: greedy outputs differ between replica counts or modes", file=sys.stderr)
    return 0 if same and spec_same else 1
