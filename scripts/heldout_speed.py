"""Speculative decoding against plain on held-out ShareGPT openings (conversations from
train/data.py's HELD_OUT_FROM on, never trained on, never a benchmark's): the development set for
choosing a proposer's settings before Spec-Bench measures it.

    python scripts/heldout_speed.py -m smollm2-135m --methods ngram,lookup-store,hybrid --prompts 24 -n 128

Per prompt the methods run interleaved (plain first), after one warm-up generation each; printed
per method: decode speed against plain (ratio of the summed decode times over the summed tokens,
prefill excluded), tokens per target pass, and whether every output equals plain decoding's.
"""
from __future__ import annotations

import argparse
import itertools
import json

import quickdraft
from quickdraft import SamplingParams, SpecConfig
from quickdraft.engine.startup import set_threads
from quickdraft.train.data import HELD_OUT_FROM, iter_sharegpt, sharegpt_path


def openings(n: int, max_chars: int = 1500) -> list[list[dict]]:
    """The first n held-out openings (system message if any, first user turn) of at most max_chars."""
    out = []
    for messages in itertools.islice(iter_sharegpt(sharegpt_path("bench")), HELD_OUT_FROM, None):
        opening = messages[:2] if messages[0]["role"] == "system" else messages[:1]
        if opening[-1]["role"] == "user" and sum(len(m["content"]) for m in opening) <= max_chars:
            out.append(opening)
            if len(out) == n:
                return out
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("--methods", default="ngram,lookup-store")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    set_threads(args.threads)
    llm = quickdraft.load(args.model, prefix_cache_mb=0)
    methods = ["none", *args.methods.split(",")]
    specs = {m: SpecConfig(m, k=args.k) for m in methods}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = openings(args.prompts)
    for m in methods:  # warm-up: kernels, tables, the datastore's index
        llm.generate(messages=prompts[0], params=SamplingParams(max_new_tokens=8), spec=specs[m])
    totals = {m: {"decode_s": 0.0, "tokens": 0, "passes": 0, "same": 0} for m in methods}
    for messages in prompts:
        ref = None
        for m in methods:
            out = llm.generate(messages=messages, params=params, spec=specs[m])
            s, t = out.stats, totals[m]
            t["decode_s"] += s.total_s - s.ttft_s
            t["tokens"] += max(s.new_tokens - 1, 0)   # the first token comes with the prefill
            t["passes"] += s.target_passes - 1
            ref = out.token_ids if ref is None else ref
            t["same"] += out.token_ids == ref
    plain = totals["none"]["tokens"] / totals["none"]["decode_s"]
    result = {m: {"speedup": round(t["tokens"] / t["decode_s"] / plain, 3),
                  "tokens_per_pass": round(t["tokens"] / max(t["passes"], 1), 3),
                  "identical": f"{t['same']}/{len(prompts)}"} for m, t in totals.items()}
    if args.json:
        print(json.dumps({"model": args.model, "prompts": len(prompts), "methods": result}))
        return
    print(f"{args.model}, {len(prompts)} held-out ShareGPT openings, {args.max_new_tokens} tokens, "
          f"{args.threads} threads (plain decode {plain:.1f} tokens/s)")
    for m, r in result.items():
        print(f"  {m:14s} {r['speedup']:.3f}x plain   {r['tokens_per_pass']:.2f} tokens/pass   identical {r['identical']}")


if __name__ == "__main__":
    main()
