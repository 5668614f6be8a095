"""`quickdraft generate`: one prompt, streamed to the terminal; --compare measures plain vs speculative
(interleaved rounds, and a verdict that says when there is no speedup to claim)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass

import torch

from quickdraft import kernels
from quickdraft.cli.common import load_llm, sampling_from_args, spec_from_args, stats_line
from quickdraft.engine.startup import set_threads
from quickdraft.errors import QuickdraftError
from quickdraft.proposers import DEFAULT_METHOD, SpecConfig
from quickdraft.weights import load_tokenizer
from quickdraft.weights.resolve import resolve_model

PLAIN = SpecConfig(method="none")
ROUNDS = 3          # --compare: plain and speculative runs, interleaved, medians compared
NOISE_FLOOR = 0.03  # a difference below this is never called a speedup, however steady the plain runs


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
        raise QuickdraftError("give a prompt: --prompt TEXT (raw) or --chat MESSAGE (chat template); - reads stdin")
    if args.system is not None and args.chat is None:
        raise QuickdraftError("--system is a chat's system message: give the message with --chat, not --prompt")
    if args.compare and not spec.enabled:
        raise QuickdraftError(f"--compare needs a proposer: leave --spec at its default ({DEFAULT_METHOD}) or name "
                              "one (ngram, head, hybrid, draft [--draft-model PATH]) with -k >= 1")
    args.prompt, args.chat = (sys.stdin.read() if text == "-" else text for text in (args.prompt, args.chat))
    if args.chat is not None and not load_tokenizer(resolve_model(args.model)).has_chat_template:
        raise QuickdraftError(f"{args.model or 'the model'} has no chat template, so --chat cannot format a "
                              f"message; give the text with --prompt (raw text, continued as written)")
    set_threads(args.threads)  # before the load: the kernels and the engine read it from then on
    progress = sys.stderr.isatty() and not args.json
    llm = load_llm(args, spec, progress)
    if args.compare:  # warm both paths first (caches, thread pools, the policy's timings): warm runs compared
        warm = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 16))
        for s in (PLAIN, spec):
            _run(llm, args, warm, s, echo=False)
    plains, results = [], []
    for last in [False] * (ROUNDS - 1 if args.compare else 0) + [True]:  # interleaved: drift falls on both
        if args.compare:
            plains.append(_run(llm, args, params, PLAIN, echo=False))
        results.append(_run(llm, args, params, spec, echo=last and not args.json))
    result, plain = results[-1], plains[-1] if plains else None
    if not args.json:
        if plain is not None:
            print(f"plain:       {stats_line(plain['_stats'], plain['finish_reason'])}", file=sys.stderr)
        ran = result["proposer"] if spec.enabled else None
        print(f"{'speculative: ' if plain else ''}"
              f"{stats_line(result['_stats'], result['finish_reason'], ran, spec.method)}", file=sys.stderr)
    if plain is not None:
        compared = Comparison.of(plains, results)
        identical = all(p["token_ids"] == r["token_ids"] for p, r in zip(plains, results))
        if not args.json:
            print(f"{compared.verdict(result['proposer'], spec.k)}; outputs identical: {'yes' if identical else 'no'}"
                  f"{'' if params.greedy else ' (sampling: outputs differ by design)'}", file=sys.stderr)
    if args.json:
        out = {key: value for key, value in result.items() if not key.startswith("_")}
        out["runtime"] = {"weights": llm.model.weight_format, "kernel": kernels.kernel_info().as_dict(),
                          "threads": torch.get_num_threads()}
        if plain is not None:
            out.update(plain={key: value for key, value in plain.items() if not key.startswith("_")},
                       speculative={key: value for key, value in result.items() if not key.startswith("_")},
                       speedup=compared.speedup, noise=compared.noise, drafted=compared.drafted,
                       median_tokens_per_s={"plain": compared.plain_tps, "speculative": compared.spec_tps},
                       rounds=ROUNDS, identical=identical)
        print(json.dumps(out))
    return 0


@dataclass(frozen=True)
class Comparison:
    """Plain against speculative decoding over interleaved rounds: medians, and what they can say."""
    plain_tps: float   # median tokens/s of the plain runs
    spec_tps: float    # ... of the speculative runs
    noise: float       # the plain runs' spread around their median, (max - min) / 2 / median: run-to-run noise
    drafted: int       # tokens the proposer drafted, all rounds

    @classmethod
    def of(cls, plains: list[dict], results: list[dict]) -> Comparison:
        rates = [p["tokens_per_s"] for p in plains]
        median = statistics.median(rates)
        return cls(median, statistics.median(r["tokens_per_s"] for r in results),
                   (max(rates) - min(rates)) / 2 / median if median else 0.0,
                   sum(r["_stats"].drafted_tokens for r in results))

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0

    def verdict(self, proposer: str, k: int) -> str:
        """The speedup, and where it is none: nothing drafted, or within the plain runs' own spread."""
        figures = (f"{self.speedup:.2f}x ({proposer}, k={k}: {self.spec_tps:.1f} vs {self.plain_tps:.1f} tokens/s, "
                   f"medians of {ROUNDS} interleaved runs)")
        if not self.drafted:
            return (f"no speedup: nothing was drafted (1.00 tokens per pass), so speculative decoding ran as plain "
                    f"decoding; the measured {figures} is noise")
        if abs(self.speedup - 1) <= max(self.noise, NOISE_FLOOR):
            return f"no clear speedup: {figures} is within the run-to-run noise (plain runs +-{self.noise:.0%})"
        return f"speedup {figures}"


