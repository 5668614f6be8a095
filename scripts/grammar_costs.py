"""What a JSON-schema grammar costs with xgrammar and with llguidance on this CPU: compiling a
schema, and computing the allowed-token mask at each position of a valid answer (the cost a
constrained decode step pays per row and per drafted position), with the default model's
tokenizer (SmolLM2, 49k tokens). Reads the GGUF's tokenizer only: no weights are loaded.

    python scripts/grammar_costs.py [--model smollm2-135m] [--repeat 3]

Prints one line per library and schema: compile ms, and the mask's median / p90 / max us per token.
llguidance is quickdraft's (a dependency); xgrammar, the comparison, needs `pip install
xgrammar==0.2.8` (it brings triton, ~1 GB): without it, its lines say so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quickdraft.model.tokenizer import gguf_tokenizer
from quickdraft.weights import gguf_file, resolve_model

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "email": {"type": "string"}},
                "required": ["name", "age", "email"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "invoice": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["draft", "sent", "paid"]}, "note": {"type": ["string", "null"]}},
        "required": ["id", "items", "status", "note"], "additionalProperties": False},
        {"id": "INV-0042", "items": [{"sku": "A-1", "qty": 2, "price": 9.5}, {"sku": "B-7", "qty": 1, "price": 120}],
         "status": "sent", "note": None}),
    "json_object": ({"type": "object"}, {"summary": "any JSON object", "tags": ["a", "b"], "n": 3}),
}


SETUP: dict[str, float] = {}  # library -> seconds to prepare the vocabulary (once per model)


def tokenizer(model: str):
    source = resolve_model(model)
    return gguf_tokenizer(gguf_file.read_metadata(gguf_file.open_reader(source.path))).hf


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def bench_llguidance(hf, vocab: int, ids: list[int], schema: dict) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    tok, setup_s = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab))
    SETUP.setdefault("llguidance", setup_s)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(tok, grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask = lt.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        _, s = timed(lambda: lt.fill_next_token_bitmask(matcher, mask, 0))
        times.append(s)
        assert matcher.consume_token(t), (t, matcher.get_error())
    return compile_s, times


def bench_xgrammar(hf, vocab: int, ids: list[int], schema: dict) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info, setup_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    SETUP.setdefault("xgrammar", setup_s)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    if schema == {"type": "object"}:  # strict mode would allow no properties: its any-JSON grammar
        compiled, compile_s = timed(compiler.compile_builtin_json_grammar)
    else:
        compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                         separators=(",", ":")))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        _, s = timed(lambda: matcher.fill_next_token_bitmask(mask, 0))
        times.append(s)
        assert matcher.accept_token(t), t
    return compile_s, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3, help="runs per library and schema (the best is shown)")
    args = ap.parse_args()
    hf = tokenizer(args.model)
    vocab = len(hf)
    torch.set_num_threads(1)
    print(f"{args.model}: vocabulary {vocab}")
    for lib, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            __import__(lib)
        except ImportError:
            print(f"{lib:10s} not installed (pip install {lib})")
            continue
        for name, (schema, answer) in SCHEMAS.items():
            ids = hf.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False)
            runs = [bench(hf, vocab, ids, schema) for _ in range(args.repeat)]
            compile_s = min(r[0] for r in runs)
            per_token = [min(r[1][i] for r in runs) for i in range(len(ids))]
            q = statistics.quantiles(per_token, n=10)
            print(f"{lib:10s} {name:11s} compile {compile_s * 1e3:7.1f} ms   mask per token: median "
                  f"{statistics.median(per_token) * 1e6:6.0f} us  p90 {q[-1] * 1e6:6.0f} us  "
                  f"max {max(per_token) * 1e6:6.0f} us  ({len(ids)} tokens)")
        print(f"{lib:10s} vocabulary set-up (once per model) {SETUP[lib] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
