"""Flags shared by the commands: model, sampling and speculation, turned into validated configs."""
from __future__ import annotations

import argparse
from typing import Any

from quickdraft.api import DTYPES, LLM, load
from quickdraft.engine.events import GenerationStats
from quickdraft.errors import QuickdraftError
from quickdraft.kv.prefix_cache import DEFAULT_MB
from quickdraft.proposers import DEFAULT_K, DEFAULT_METHOD, PROPOSERS, SpecConfig
from quickdraft.proposers.registry import option_fields
from quickdraft.spec.sampling import SamplingParams
from quickdraft.weights.activations import ACTIVATIONS
from quickdraft.weights.quantize import SCHEMES
from quickdraft.weights.resolve import DEFAULT_MODEL


def add_model_args(p: argparse.ArgumentParser, weight_formats: bool = True) -> None:
    """`weight_formats`: also --dequantize / --quantize / --activations, for commands that load through load_llm."""
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"packaged name, HF model directory or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="activations and unquantized weights (default: float32)")
    if not weight_formats:
        return
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--dequantize", action="store_true",
                         help="dequantize a quantized GGUF to --dtype at load (default: run it as stored)")
    weights.add_argument("--quantize", choices=sorted(SCHEMES),
                         help="quantize float weights at load, group-wise (int8: Q8_0, int4: Q4_1)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--prefix-cache-mb", type=int, metavar="MIB",
                       help="memory for the K/V of earlier prompts and answers, which a prompt starting with the "
                            f"same tokens reuses instead of prefilling them (default: {DEFAULT_MB} MiB, at most an "
                            "eighth of this machine's memory; 0: none)")
    cache.add_argument("--no-prefix-cache", action="store_true",
                       help="prefill every prompt whole (no K/V kept across requests)")
    p.add_argument("--activations", choices=list(ACTIVATIONS),
                   help="what the integer kernel rounds activations to for quantized weights: int8 halves "
                        "the multiplies of verification and prefill, int16 tracks float32 more closely "
                        "(default: int8 where measured within the quality bar, see docs/results.md)")


def load_llm(args: argparse.Namespace, spec: SpecConfig | None = None, progress: bool = False,
             prefix_cache: bool = True) -> LLM:
    """The model the flags of add_model_args name, loaded as they ask (`prefix_cache`: False for a
    benchmark that times the same prompts again)."""
    return load(progress=progress, **load_kwargs(args, spec, prefix_cache))


def load_kwargs(args: argparse.Namespace, spec: SpecConfig | None = None, prefix_cache: bool = True) -> dict[str, Any]:
    """quickdraft.load's arguments from the flags of add_model_args (a cluster's replicas load with them)."""
    return {"model": args.model, "device": args.device, "dtype": args.dtype, "spec": spec,
            "dequantize": args.dequantize, "quantize": args.quantize, "activations": args.activations,
            "prefix_cache_mb": args.prefix_cache_mb if prefix_cache and not args.no_prefix_cache else 0}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens whatever the model says")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams; a command that generates asks for at least one token
    (max_new_tokens 0, a prompt only scored, is the API's and the server's: LLM.score, echo)."""
    if args.max_new_tokens < 1:
        raise QuickdraftError(f"max_new_tokens must be at least 1 (-n), found {args.max_new_tokens}")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """--spec, -k and every proposer option, from the registry: each default stays where it is defined."""
    about = "; ".join(f"{name} = {entry.about}" for name, entry in sorted(PROPOSERS.items()))
    p.add_argument("--spec", default=DEFAULT_METHOD, choices=["none", *sorted(PROPOSERS)],
                   help=f"proposer for speculative decoding (default: {DEFAULT_METHOD}): none = plain decoding; "
                        f"{about}")
    p.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft tokens per step at most (default {DEFAULT_K})")
    p.add_argument("--draft-model", help="draft model for --spec draft (name, HF directory or .gguf); default: the "
                                         "packaged draft of a packaged target (qwen2.5-coder-1.5b: qwen2.5-coder-0.5b)")
    p.add_argument("--head", help="trained draft head directory for --spec head|hybrid|auto (quickdraft train-head); "
                                  "default: the head that ships for the model")
    p.add_argument("--datastore", help="datastore file of the target's answers for --spec store|lookup-store "
                                       "(quickdraft build-datastore); default: the one that ships for the model")
    add_option_args(p)


def add_option_args(p: argparse.ArgumentParser) -> None:
    """One flag per proposer option (--ngram-max ...); unset flags keep the option's default."""
    for name, f in option_fields().items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(f.default), default=None,
                       help=f"{f.metadata.get('help', name)} (default {f.default})")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in option_fields() if getattr(args, name, None) is not None}


def spec_from_args(args: argparse.Namespace) -> SpecConfig:
    return SpecConfig(method=args.spec, k=args.k, draft_model=args.draft_model, head=args.head,
                      options=options_from_args(args), datastore=args.datastore)


def stats_line(stats: GenerationStats, finish: str | None, proposer: str | None = None, asked: str | None = None) -> str:
    """The stats of one generation on one line; `proposer`: the one that ran (None: plain decoding),
    `asked`: the name asked for, said beside it where it picked another (auto)."""
    cached = f" ({stats.cached_tokens} cached)" if stats.cached_tokens else ""
    line = (f"prompt {stats.prompt_tokens} tokens{cached} | new {stats.new_tokens} tokens | "
            f"ttft {stats.ttft_s * 1000:.0f} ms | {stats.tokens_per_s:.1f} tokens/s | "
            f"{stats.target_passes} target passes, {stats.tokens_per_pass:.2f} tokens/pass")
    if stats.drafted_tokens:
        by_pos = " ".join(f"{r:.2f}" for r in stats.acceptance_by_position)
        line += (f" | acceptance {stats.acceptance_rate:.0%} of {stats.drafted_tokens} drafted "
                 f"(by position: {by_pos}) | propose {stats.propose_s:.2f}s verify {stats.verify_s:.2f}s "
                 f"other {stats.other_s:.2f}s")
    if proposer is not None:
        line += f" | proposer: {proposer}" + (f" ({asked})" if asked and asked != proposer else "")
    return f"[{line} | finish: {finish}]"
