"""`quickdraft generate`: one prompt, streamed to the terminal; --compare measures plain vs speculative."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from quickdraft.cli.common import load_llm, sampling_from_args, set_threads, spec_from_args, stats_line
from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import DEFAULT_METHOD, SpecConfig

PLAIN = SpecConfig(method="none")


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
    # the proposer that ran, by its registered name ("auto" spelled out); "none": plain decoding
    proposer = llm.proposer_name(spec) or "none"
    return {"text": "".join(chunks), "token_ids": ids, "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens, "ttft_s": stats.ttft_s, "tokens_per_s": stats.tokens_per_s,
            "finish_reason": chunk.finish_reason, "proposer": proposer,
            "spec": {"method": spec.method, "k": spec.k}, "stats": stats.to_dict(), "_stats": stats}


def cmd_generate(args: argparse.Namespace) -> int:
    params, spec = sampling_from_args(args), spec_from_args(args)  # validate before the slow load
    if args.prompt is None and args.chat is None:
        raise QuickdraftError("give a prompt: --prompt TEXT (raw) or --chat MESSAGE (chat template)")
    if args.compare and not spec.enabled:
        raise QuickdraftError(f"--compare needs a proposer: leave --spec at its default ({DEFAULT_METHOD}) or name "
                              "one (ngram, head, hybrid, draft [--draft-model PATH]) with -k >= 1")
    set_threads(args.threads)  # before the load: the kernels and the engine read it from then on
    progress = sys.stderr.isatty() and not args.json
    llm = load_llm(args, spec, progress)
    if args.compare:  # warm both paths first (caches, thread pools, the policy's timings): warm runs compared
        warm = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 16))
        for s in (PLAIN, spec):
            _run(llm, args, warm, s, echo=False)
    plain = _run(llm, args, params, PLAIN, echo=False) if args.compare else None
    result = _run(llm, args, params, spec, echo=not args.json)
    if not args.json:
        if plain is not None:
            print(f"plain:       {stats_line(plain['_stats'], plain['finish_reason'])}", file=sys.stderr)
        ran = result["proposer"] if spec.enabled else None
        print(f"{'speculative: ' if plain else ''}"
              f"{stats_line(result['_stats'], result['finish_reason'], ran, spec.method)}", file=sys.stderr)
    if plain is not None:
        speedup = result["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
        identical = plain["token_ids"] == result["token_ids"]
        if not args.json:
            print(f"speedup {speedup:.2f}x ({result['proposer']}, k={spec.k}: {result['tokens_per_s']:.1f} vs "
                  f"{plain['tokens_per_s']:.1f} tokens/s); outputs identical: {'yes' if identical else 'no'}"
                  f"{'' if params.greedy else ' (sampling: outputs differ by design)'}", file=sys.stderr)
    if args.json:
        out = {key: value for key, value in result.items() if not key.startswith("_")}
        out["runtime"] = {"weights": llm.model.weight_format, "kernel": kernels.kernel_info().as_dict(),
                          "threads": torch.get_num_threads()}
        if plain is not None:
            out.update(plain={key: value for key, value in plain.items() if not key.startswith("_")},
                       speculative={key: value for key, value in result.items() if not key.startswith("_")},
                       speedup=speedup, identical=identical)
        print(json.dumps(out))
    return 0


