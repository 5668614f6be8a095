"""`quickdraft serve`: flags -> a loaded model, speculation defaults and engine settings -> uvicorn."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.cli.common import add_model_args, add_spec_args, load_kwargs, load_llm, spec_from_args
from quickdraft.cluster import ROUTER_NAMES
from quickdraft.engine.batch import EngineConfig
from quickdraft.engine.policy import POLICIES
from quickdraft.engine.startup import start_serving
from quickdraft.errors import QuickdraftError
from quickdraft.extras import require

if TYPE_CHECKING:
    from quickdraft.server import ServerConfig

API_KEY_ENV = "QUICKDRAFT_API_KEY"  # the key, when not given by --api-key (which would show in `ps`)


def cmd_serve(args: argparse.Namespace) -> int:
    from quickdraft.server import ServerConfig, listen, serve
    from quickdraft.server.connections import ConnectionLimits

    spec = spec_from_args(args)
    try:
        engine = EngineConfig(max_batch=args.max_batch, max_seq_len=args.max_seq_len, policy=args.policy,
                              max_step_tokens=args.max_step_tokens)
        limits = {k: v for k, v in (("max_body_bytes", args.max_body_bytes), ("max_waiting", args.max_waiting),
                                    ("max_request_tokens", args.max_request_tokens),
                                    ("api_keys", api_keys(args)),
                                    ("allowed_hosts", tuple(args.allowed_host))) if v is not None}
        limits["connections"] = ConnectionLimits(**{k: v for k, v in (
            ("max_connections", args.max_connections), ("header_timeout_s", args.header_timeout),
            ("body_timeout_s", args.body_timeout), ("max_connections_per_peer", args.max_connections_per_peer),
            ("min_body_rate", args.min_body_rate)) if v is not None})
        ServerConfig("check", spec, engine, **limits)  # the flags are checked before the model loads
    except ValueError as e:
        raise QuickdraftError(str(e)) from None
    if not 0 < args.port < 65536:
        raise QuickdraftError(f"--port must be in 1..65535, found {args.port}")
    name = args.served_model_name or (args.model if not Path(args.model).exists() else Path(args.model).name)
    if args.replicas != 1 or args.ray_address is not None:
        return serve_replicas(args, ServerConfig(name, spec, engine, **limits))
    sock = listen(args.host, args.port)  # before the model loads: a port in use is an error at once
    llm, cost = start_serving(args.threads, lambda: load_llm(args, spec, progress=sys.stderr.isatty()), args.policy,
                        measure=not args.no_measure_cost)
    print(f"quickdraft: serving {name!r} on http://{args.host}:{args.port}/v1, a playground on "
          f"http://{args.host}:{args.port}/ (max batch {engine.max_batch}, "
          f"speculation {spec.method}{f' k={spec.k}' if spec.enabled else ''}, policy {args.policy}"
          f"{api_note(limits.get('api_keys', ()))})", file=sys.stderr)
    serve(llm, ServerConfig(name, spec, engine, **limits), args.host, args.port, args.shutdown_timeout, cost,
          args.log_level, sock)
    return 0


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (repeated) and --api-key-file's keys, else the environment's one key; () for none."""
    keys = list(args.api_key)
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise QuickdraftError(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise QuickdraftError(f"--api-key-file: {args.api_key_file} holds no key")
    if not keys and os.environ.get(API_KEY_ENV) is not None:
        keys = [os.environ[API_KEY_ENV]]
    return tuple(dict.fromkeys(keys))


def api_note(keys: tuple[str, ...]) -> str:
    return "" if not keys else ", API key required" if len(keys) == 1 else f", {len(keys)} API keys (tenants)"


def serve_replicas(args: argparse.Namespace, config: ServerConfig) -> int:
    """--replicas N / --ray-address: the same server as N engine replicas on Ray Serve (quickdraft/cluster/)."""
    if args.replicas < 1 or (args.threads is not None and args.threads < 1):
        raise QuickdraftError(f"--replicas and --threads must be >= 1, found {args.replicas} and {args.threads}")
    require("cluster", "ray", needed_for=f"quickdraft serve --replicas {args.replicas}")
    from quickdraft.cluster.launch import ClusterPlan, serve_cluster
    from quickdraft.cluster.replica import ReplicaSetup
    from quickdraft.server import listen
    sock = listen(args.host, args.port)
    setup = ReplicaSetup(config, load_kwargs(args, config.spec), bind=args.host, policy=args.policy,
                         measure_cost=not args.no_measure_cost)
    plan = ClusterPlan(args.replicas, args.threads, args.ray_address, args.router)
    print(f"quickdraft: starting {plan.replicas} replicas of {config.model_name!r} on Ray "
          f"({plan.address or 'a local cluster'}, {plan.router} routing); serving on http://{args.host}:{args.port}/v1 "
          f"once every replica has loaded", file=sys.stderr)
    serve_cluster(setup, plan, args.model, sock, args.shutdown_timeout, args.log_level)
    return 0


def add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    add_model_args(sv)
    add_spec_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", help="the model id clients send (default: --model's name)")
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    sv.add_argument("--max-seq-len", type=int, default=4096,
                    help="prompt + new tokens per request, capped by the model's context (default 4096)")
    sv.add_argument("--policy", default="goodput", choices=POLICIES,
                    help="draft lengths per step: goodput = expected tokens per second from measured step "
                         "times (shrinks drafts as the batch grows); fixed = every offered draft token")
    sv.add_argument("--max-step-tokens", type=int, default=64,
                    help="goodput policy: at most this many tokens fed per step (default 64)")
    sv.add_argument("--no-measure-cost", action="store_true",
                    help="skip measuring the forward-cost curve at start-up (the policy then starts from a prior)")
    sv.add_argument("--max-body-bytes", type=int,
                    help="larger request bodies get a 413 before they are parsed (default 1048576 = 1 MiB)")
    sv.add_argument("--max-waiting", type=int,
                    help="generation requests that may wait for a batch row; more get a 429 with Retry-After "
                         "(default 64)")
    sv.add_argument("--max-request-tokens", type=int, metavar="N",
                    help="new tokens one request may ask for over all its choices: n x max_tokens (n x the context's "
                         "rest where max_tokens is unset); more is a 400 (default: 4 x the context, so every "
                         "single-choice request fits)")
    sv.add_argument("--max-connections", type=int,
                    help="connections open at once; one more is answered 503 and closed at once (default 256)")
    sv.add_argument("--max-connections-per-peer", type=int, metavar="N",
                    help="connections one client address (an IPv6 /64) may hold; one more is answered 429 and closed "
                         "at once (default: half of --max-connections, at least 16; behind a reverse proxy every "
                         "client is the proxy: give --max-connections)")
    sv.add_argument("--header-timeout", type=float, metavar="SECONDS",
                    help="a request's line and headers must arrive within this many seconds of the connection's "
                         "opening or the request's first byte, else a 408 and the connection closed (default 10)")
    sv.add_argument("--body-timeout", type=float, metavar="SECONDS",
                    help="a request's whole body must arrive within this many seconds of its headers, else a 408 "
                         "and the connection closed (default 30)")
    sv.add_argument("--min-body-rate", type=int, metavar="BYTES_PER_S",
                    help="after 5 s, a request's body must have come at this many bytes a second on average, else "
                         "a 408 and the connection closed (default 1024; 0: no minimum)")
    sv.add_argument("--api-key", action="append", default=[], metavar="KEY",
                    help=f"require Authorization: Bearer KEY (401 otherwise) on every route but /health, /metrics, "
                         f"/openapi.json and the playground's page, files and config; repeatable: each key is a tenant whose "
                         f"requests share prefix-cache entries with no other's (docs/server.md); default: the "
                         f"environment variable {API_KEY_ENV}")
    sv.add_argument("--api-key-file", metavar="FILE",
                    help="API keys, one a line (blank lines and lines starting with # skipped), as --api-key; "
                         "keeps them out of the process list")
    sv.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                    help="a Host header name to answer besides 127.0.0.1, localhost and ::1, which alone are "
                         "answered when bound to loopback (DNS rebinding); bound elsewhere, if given, only "
                         "these (repeatable)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    sv.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); with --replicas, each "
                                                "replica's (its CPUs in Ray; default: the cluster's CPUs shared out)")
    sv.add_argument("--replicas", type=int, default=1,
                    help="engine replicas on Ray Serve behind this process, each prompt routed to the replica "
                         "holding its longest cached prefix (needs quickdraft[cluster]; default 1: this process "
                         "alone, no Ray)")
    sv.add_argument("--ray-address", metavar="ADDR",
                    help="join this Ray cluster (`ray start --head` on one machine, `ray start --address ADDR` on "
                         "the others) instead of starting one on this machine (docs/cluster.md)")
    sv.add_argument("--router", default="prefix", choices=ROUTER_NAMES,
                    help="with --replicas: prefix = the replica holding the prompt's longest cached prefix, "
                         "balanced against queues; round-robin = each in turn (default prefix)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)
