"""`quickdraft bench soak`: the server in this process under mixed traffic (quickdraft/bench/soak.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quickdraft.cli.common import add_model_args, load_llm
from quickdraft.engine.startup import set_threads
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import DEFAULT_K, DEFAULT_METHOD


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from quickdraft.bench.soak import Soak
    from quickdraft.bench.soak_memory import own_rss
    from quickdraft.engine.batch import EngineConfig
    from quickdraft.proposers import SpecConfig
    from quickdraft.server import BackgroundServer, ServerConfig
    from quickdraft.server.connections import ConnectionLimits

    if args.duration <= 0 or args.concurrency < 1 or args.max_batch < 1:
        raise QuickdraftError("--duration must be > 0, --concurrency and --max-batch >= 1")
    spec = SpecConfig(method=args.spec, k=args.k, draft_model=args.draft_model)
    set_threads(args.threads)
    llm = load_llm(args, spec, progress=sys.stderr.isatty())
    engine = EngineConfig(max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    # short timeouts, so that the stalled requests of the mix turn over within seconds
    config = ServerConfig("soak", spec, engine, connections=ConnectionLimits(header_timeout_s=2.0, body_timeout_s=3.0))
    server = BackgroundServer(llm, config, engine_thread=False)
    limits = config.connections
    soak = Soak(server.url, config.model_name, own_rss, config.max_body_bytes, args.seed,
                header_timeout_s=limits.header_timeout_s, body_timeout_s=limits.body_timeout_s)
    reports = []
    server.run_clients(lambda: reports.append(soak.run(args.duration, args.concurrency, progress=lambda line: print(
        f"soak: {line}", file=sys.stderr))), "soak-clients")
    if not reports:
        raise QuickdraftError("the soak failed; see the error above")
    report = reports[0]
    result = {"command": " ".join(["quickdraft", *sys.argv[1:]]), **report.as_dict()}
    print(json.dumps(result) if args.json else report.summary())
    if not report.passed and not args.json:
        for failure in report.failures[:10]:
            print(f"  {failure}", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if report.passed else 1


def add_bench_soak(bsub) -> None:
    sk = bsub.add_parser("soak", help="the server under mixed valid, malformed, cancelled and oversized requests "
                                      "and hostile clients (slow, stalled, huge, floods) for a while: no 5xx, "
                                      "valid answers as alone, flat memory")
    add_model_args(sk)
    sk.add_argument("--spec", default=DEFAULT_METHOD, help=f"the server's default proposer (default {DEFAULT_METHOD})")
    sk.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft tokens per step (default {DEFAULT_K})")
    sk.add_argument("--draft-model", help="draft model for --spec draft")
    sk.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    sk.add_argument("--concurrency", type=int, default=4, help="clients sending at once (default 4)")
    sk.add_argument("--max-batch", type=int, default=4, help="the server's batch rows (default 4)")
    sk.add_argument("--max-seq-len", type=int, default=2048)
    sk.add_argument("--seed", type=int, default=0, help="the mix of requests (default 0)")
    sk.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sk.add_argument("--json", action="store_true", help="one JSON object")
    sk.add_argument("--out", help="write the JSON report to this file")
    sk.set_defaults(func=cmd_bench_soak)
