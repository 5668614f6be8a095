"""`quickdraft bench specbench`: Spec-Bench questions through plain decoding and each method on the
same target, same machine, same run, methods interleaved per question so machine drift cancels.

Turns a method list into runs and runs into per-question records; bench/report.py turns those
into tables, results.json and the chart. Multi-turn questions are run as Spec-Bench runs them:
turn 1 with the chat template, its text appended as the assistant message, then turn 2; both
turns' tokens and seconds count. HumanEval's prompts are raw text, continued without a template.
A question with a JSON schema (json_extraction) is answered under it by every row, plain too
(response_format json_schema: constrained plain decoding is the baseline), and its records carry
the grammar's own time. transformers and llama.cpp rows decode the same prompt ids as quickdraft's
rows.
"""
from __future__ import annotations

import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from tqdm import tqdm

from quickdraft.api import LLM, load, parse_dtype
from quickdraft.bench.questions import Question
from quickdraft.errors import QuickdraftError
from quickdraft.model.tokenizer import Message
from quickdraft.proposers import PROPOSERS, SpecConfig
from quickdraft.proposers.registry import option_names
from quickdraft.spec.sampling import SamplingParams

PLAIN = "plain"
# the other engines' rows: label -> (engine, its decoding)
HF_ROWS = {"hf-plain": ("transformers", "plain"), "hf-prompt-lookup": ("transformers", "prompt-lookup")}
LLAMACPP_ROWS = {"llama.cpp-plain": ("llama.cpp", "plain"), "llama.cpp-prompt-lookup": ("llama.cpp", "prompt-lookup")}
LLAMACPP_DRAFT_ROW = {"llama.cpp-draft": ("llama.cpp", "draft-model")}  # where a draft model is named
Prompt = Union[str, list[Message]]  # raw text to continue, or a chat (the template applied)


@dataclass(frozen=True)
class Method:
    label: str                    # the row name in every table
    spec: SpecConfig | None       # quickdraft's decoding (method "none" = plain); None for other engines' rows
    engine: str = "quickdraft"    # or "transformers", "llama.cpp": comparators on the same prompt ids
    mode: str | None = None       # another engine's decoding: "plain", "prompt-lookup" or "draft-model"

    def describe(self) -> dict[str, Any]:
        if self.spec is None:
            return {"label": self.label, "engine": self.engine, "method": self.mode, "k": None, "spec": None}
        return {"label": self.label, "engine": "quickdraft", "method": self.spec.method,
                "k": self.spec.k if self.spec.enabled else 0, "spec": asdict(self.spec)}


def parse_methods(text: str, k: int, options: Mapping[str, Any] | None = None, compare_hf: bool = False,
                  verify_all: bool = False, compare_llamacpp: bool = False,
                  default_draft: str | None = None, llamacpp_draft: bool = False) -> list[Method]:
    """`plain,ngram,ngram:8,draft,draft:8,draft:PATH,draft:PATH:2,head,head:8,head:DIR:8,hybrid:DIR,
    draft:4@draft-vocab=32768` -> methods, plain first (always run: it is the baseline). NAME:K sets
    k for one method, @OPTION=VALUE one of its proposer options (repeatable); the file
    a proposer drafts with (registry `loads`: a draft model, a head's folder, a datastore file) may
    follow NAME: (a draft model's default: `default_draft`, the target's packaged draft; a head's
    and a datastore's: the packaged one), then :K. `options` are proposer options (SpecConfig.options); unset ones keep their
    defaults. `verify_all` adds beside each speculative method the same one with the draft-length
    policy off (every offered draft token verified, label ending in "all"): what its drafts could
    commit per pass, the ceiling of its speedup, measured in the same run as what the policy makes
    of them. `compare_hf` and `compare_llamacpp` add the other engines' plain and prompt-lookup rows,
    and `llamacpp_draft` llama.cpp's draft-model row (OtherEngines.llamacpp_draft drafts)."""
    methods = [Method(PLAIN, SpecConfig(method="none"))]
    for item in (t.strip() for t in text.split(",")):
        if not item or item == PLAIN:
            continue
        item, *settings = item.split("@")
        own = _method_options(item, settings)
        name, _, arg = item.partition(":")
        if name not in PROPOSERS:
            raise QuickdraftError(f"unknown method {name!r} in --methods; valid names: "
                                  f"{', '.join([PLAIN, *sorted(PROPOSERS)])} (NAME:K sets k; draft:PATH[:K])")
        loads = PROPOSERS[name].loads
        path, k_text = None, arg
        if loads and not arg.isdigit():
            path, sep, tail = arg.rpartition(":")
            path, k_text = (path, tail) if sep and tail.isdigit() else (arg, "")
            path = path or None
        if loads == "draft_model" and not path:
            path = default_draft
            if not path:
                raise QuickdraftError(f"method {item!r}: the {name} proposer needs a model and none ships for this "
                                      f"target; name one: {name}:NAME|PATH[:K]")
        if k_text and not k_text.isdigit():
            raise QuickdraftError(f"method {item!r}: expected NAME:K with an integer K, found {k_text!r}")
        spec = SpecConfig(method=name, k=int(k_text) if k_text else k, options={**(options or {}), **own},
                          **({loads: path} if loads else {}))
        source = f"{name}:{Path(path).name}" if path else name
        label = f"{source} k={spec.k}" + "".join(f" {key}={value}" for key, value in own.items())
        methods.append(Method(label, spec))
        if verify_all:
            methods.append(Method(f"{label} all", replace(spec, adaptive=False)))
    llamacpp_rows = {**LLAMACPP_ROWS, **(LLAMACPP_DRAFT_ROW if llamacpp_draft else {})} if compare_llamacpp else {}
    for rows in (HF_ROWS if compare_hf else {}, llamacpp_rows):
        methods += [Method(label, None, engine, mode) for label, (engine, mode) in rows.items()]
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise QuickdraftError(f"--methods names the same method twice: {', '.join(labels)}")
    return methods


def _method_options(item: str, settings: list[str]) -> dict[str, int | float]:
    """A method's own proposer options, `@NAME=VALUE` each (NAME as the flag, dashes or
    underscores): two rows of one proposer with different settings in the same run."""
    own: dict[str, int | float] = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in option_names():
            raise QuickdraftError(f"method {item!r}: expected @OPTION=VALUE with one of {', '.join(option_names())}, "
                                  f"found {setting!r}")
        try:
            own[key] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            raise QuickdraftError(f"method {item!r}: option {key} needs a number, found {value!r}") from None
    return own


def _prompt_kwargs(prompt: Prompt) -> dict[str, Any]:
    return {"prompt": prompt} if isinstance(prompt, str) else {"messages": prompt}


def response_format(schema: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format for a question's schema, strict as agents send it."""
    return {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema, "strict": True}}


def _quickdraft_turn(llm: LLM, spec: SpecConfig, prompt: Prompt, params: SamplingParams,
                     schema: Mapping[str, Any] | None = None) -> dict:
    # Through the public API, as users call it: the chat template, the proposer's set-up, decoding
    # and detokenization are all timed (the same for every quickdraft row). Under a schema the
    # request goes to the engine as LLM.stream sends it, with a constraint made here so that its
    # time can be read after (compiling the schema is timed too).
    start = time.perf_counter()
    if schema is None:
        out = llm.generate(**_prompt_kwargs(prompt), params=params, spec=spec)
        ids, text, stats, finish, grammar_s = out.token_ids, out.text, out.stats, out.finish_reason, None
    else:
        constraint = llm.constraint(response_format(schema))
        request = llm.request(llm.prompt_ids(**_prompt_kwargs(prompt)), params, spec, constraint)
        ids = []
        with closing(llm.engine_service().stream(*request)) as events:
            for event in events:
                if event.error is not None:
                    raise event.error
                ids += event.token_ids
        text, stats, finish, grammar_s = llm.tokenizer.decode(ids), event.stats, event.finish_reason, constraint.seconds
    wall = time.perf_counter() - start
    return {"token_ids": ids, "text": text, "prompt_tokens": stats.prompt_tokens,
            "new_tokens": len(ids), "committed_tokens": stats.committed_tokens,
            "wall_s": wall, "target_passes": stats.target_passes, "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens, "finish_reason": finish, "grammar_s": grammar_s,
            "decode_s": stats.total_s - stats.ttft_s}  # the first token known -> the last: what speculation changes


# Another engine's decoding of prompt ids: (ids, max_new_tokens, eos) -> (tokens through the first
# EOS, seconds, target passes or None, drafted tokens or None)
Decoder = Callable[[list[int], int, frozenset[int]], tuple[list[int], float, int | None, int | None]]


def _other_engine_turn(llm: LLM, decode: Decoder, prompt: Prompt, params: SamplingParams) -> dict:
    """A turn of transformers or llama.cpp on the prompt ids quickdraft's rows decode from, timed
    around its decoding alone."""
    ids = llm.prompt_ids(**_prompt_kwargs(prompt))
    eos = llm.tokenizer.eos_token_ids
    out, wall, passes, drafted = decode(ids, params.max_new_tokens, eos)
    stop = next((i for i, t in enumerate(out) if t in eos), None)
    out = out if stop is None else out[:stop]  # the EOS is committed, not emitted (as ours)
    committed = len(out) + (stop is not None)
    return {"token_ids": out, "text": llm.tokenizer.decode(out), "prompt_tokens": len(ids), "new_tokens": len(out),
            "committed_tokens": committed, "wall_s": wall, "target_passes": passes, "drafted_tokens": drafted,
            # each pass commits the drafts it accepted and one token of its own
            "accepted_tokens": None if passes is None else committed - passes,
            "finish_reason": "stop" if stop is not None else "length", "grammar_s": None, "decode_s": None}


def _hf_decoder(hf_model: torch.nn.Module, kind: str, lookup_tokens: int) -> Decoder:
    from quickdraft.bench.hf_reference import hf_greedy, hf_prompt_lookup

    def decode(ids: list[int], n: int, eos: frozenset[int]) -> tuple[list[int], float, None, None]:
        if kind == "plain":
            out, wall = hf_greedy(hf_model, ids, n, eos_token_ids=sorted(eos))
        else:
            out, wall = hf_prompt_lookup(hf_model, ids, n, eos_token_ids=sorted(eos), num_tokens=lookup_tokens)
        return out, wall, None, None
    return decode


def _llamacpp_decoder(engine: Any, kind: str) -> Decoder:
    def decode(ids: list[int], n: int, eos: frozenset[int]) -> tuple[list[int], float, int, int]:
        start = time.perf_counter()
        if kind == "plain":
            out = engine.generate(ids, n, eos)
            passes, drafted = len(out), 0  # one token per pass, the first from the prefill
        else:
            out, passes, drafted = engine.generate(ids, n, eos)
        return out, time.perf_counter() - start, passes, drafted
    return decode


# a turn: (prompt, params, the JSON schema its answer follows or None) -> its record
TurnRunner = Callable[[Prompt, SamplingParams, Union[Mapping[str, Any], None]], dict]


def run_conversation(llm: LLM, turns: Sequence[str], params: SamplingParams, run_turn: TurnRunner,
                     chat: bool = True, schema: Mapping[str, Any] | None = None) -> list[dict]:
    """Every turn of one question: each turn's prompt is the chat so far (with the method's own
    earlier answers, as Spec-Bench does), formatted with the chat template; without `chat`, the
    one turn is raw text the model continues (HumanEval). `schema`: every answer's JSON schema."""
    if not chat:
        assert len(turns) == 1, "a raw-text question has one turn"
        return [run_turn(turns[0], params, schema)]
    messages: list[Message] = []
    records = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        record = run_turn(list(messages), params, schema)
        messages.append({"role": "assistant", "content": record["text"]})
        records.append(record)
    return records


def _first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def question_record(records: list[dict], plain_ids: list[int] | None) -> dict:
    """Per-question figures of one method from its turn records (all turns summed)."""
    ids = [t for r in records for t in r["token_ids"]]
    new = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    passes = None if records[0]["target_passes"] is None else sum(r["target_passes"] for r in records)
    drafted = None if passes is None else sum(r["drafted_tokens"] for r in records)
    accepted = None if passes is None else sum(r["accepted_tokens"] for r in records)
    committed = sum(r["committed_tokens"] for r in records)
    grammar = [r["grammar_s"] for r in records]
    decode_s = [r.get("decode_s") for r in records]
    decode = None if None in decode_s or sum(decode_s) <= 0 else (new - len(records)) / sum(decode_s)
    diff = None if plain_ids is None else _first_difference(ids, plain_ids)
    return {
        "new_tokens": new, "committed_tokens": committed, "wall_s": wall,
        "tokens_per_s": new / wall if wall > 0 else 0.0, "target_passes": passes,
        "decode_tokens_per_s": decode,  # each turn's tokens after its first (the prefill's) per second
        "tokens_per_pass": committed / passes if passes else None,
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "grammar_s": None if None in grammar else sum(grammar),
        "identical_to_plain": None if plain_ids is None else diff is None, "first_difference": diff,
        "turns": [{k: v for k, v in r.items() if k not in ("token_ids", "text")} for r in records],
    }


@dataclass(frozen=True)
class OtherEngines:
    """Settings of the transformers and llama.cpp rows."""
    hf_lookup_tokens: int = 10        # transformers' prompt_lookup_num_tokens
    llamacpp_lookup_tokens: int = 10  # the binding's LlamaPromptLookupDecoding: num_pred_tokens ...
    llamacpp_ngram: int = 2           # ... and max_ngram_size (its default)
    threads: int | None = None        # llama.cpp's threads; None: torch's count, as quickdraft's
    llamacpp_draft: Path | None = None  # the GGUF llama.cpp's draft-model row drafts with
    llamacpp_draft_max: int = 16      # its draft tokens per step at most (llama.cpp's --draft-max default)


TURN_ROOM = 32  # context kept per turn beyond its new tokens: chat tags, re-tokenized answers


def llamacpp_context(llm: LLM, questions: Sequence[Question], max_new_tokens: int) -> int:
    """llama.cpp's context length: the longest question, every turn's prompt and answer, within
    the model's positions (a context sized for the model's 32k positions would cost gigabytes)."""
    def need(q: Question) -> int:
        if not q.chat:
            return len(llm.prompt_ids(prompt=q.turns[0])) + max_new_tokens
        chat = llm.prompt_ids(messages=[{"role": "user", "content": t} for t in q.turns])
        return len(chat) + len(q.turns) * (max_new_tokens + TURN_ROOM)
    return min(llm.model.config.max_position_embeddings, max(map(need, questions)))


def _runners(llm: LLM, methods: Sequence[Method], device: str, others: OtherEngines,
             n_ctx: int) -> tuple[dict[str, TurnRunner], list[Callable[[], None]]]:
    """Each method's turn runner, and what must be closed after the run."""
    runners: dict[str, TurnRunner] = {}
    closers: list[Callable[[], None]] = []
    hf_model = None
    for m in methods:
        if m.engine == "quickdraft":
            runners[m.label] = lambda prompt, p, schema, spec=m.spec: _quickdraft_turn(llm, spec, prompt, p, schema)
            continue
        if m.engine == "transformers":
            if hf_model is None:
                from quickdraft.bench.hf_reference import load_hf_model
                hf_model = load_hf_model(llm.loaded.source, llm.model.dtype, device)
            decode = _hf_decoder(hf_model, m.mode, others.hf_lookup_tokens)
        else:
            from quickdraft.bench.llamacpp_engine import LlamaCppDraftModel, LlamaCppEngine, LlamaCppPromptLookup
            threads, path = others.threads or torch.get_num_threads(), llm.loaded.source.path
            if m.mode == "plain":
                engine = LlamaCppEngine(path, threads, n_ctx)
            elif m.mode == "prompt-lookup":
                engine = LlamaCppPromptLookup(path, threads, n_ctx, others.llamacpp_lookup_tokens, others.llamacpp_ngram)
            else:
                engine = LlamaCppDraftModel(path, threads, n_ctx, others.llamacpp_draft, others.llamacpp_draft_max)
            closers.append(engine.close)
            decode = _llamacpp_decoder(engine, m.mode)
        runners[m.label] = lambda prompt, p, schema, decode=decode: _other_engine_turn(llm, decode, prompt, p)
    return runners, closers


def _check_greedy_comparators(methods: Sequence[Method], temperature: float) -> None:
    others = sorted({m.engine for m in methods if m.engine != "quickdraft"})
    if temperature > 0 and others:
        raise QuickdraftError(f"--compare-hf and --compare-llamacpp run {' and '.join(others)} greedily; "
                              f"use --temperature 0 with them")


def check_schemas(questions: Sequence[Question], methods: Sequence[Method]) -> None:
    """Questions with a JSON schema are answered under it; the other engines' rows cannot apply one."""
    others = sorted({m.engine for m in methods if m.engine != "quickdraft"})
    constrained = sorted({q.group for q in questions if q.schema is not None})
    if others and constrained:
        raise QuickdraftError(f"group {', '.join(constrained)} answers under a JSON schema, which the "
                              f"{' and '.join(others)} rows cannot apply; leave out --compare-hf and "
                              f"--compare-llamacpp, or that group")


def check_llamacpp(model: str | None, methods: Sequence[Method]) -> None:
    """Before any slow load: llama.cpp rows need the llamacpp extra and a GGUF model."""
    if not any(m.engine == "llama.cpp" for m in methods):
        return
    from quickdraft.bench.llamacpp_engine import import_llama_cpp
    from quickdraft.weights.resolve import resolve_model
    import_llama_cpp()
    source = resolve_model(model)
    if source.kind != "gguf":
        raise QuickdraftError(f"--compare-llamacpp runs llama.cpp on the same file, so it needs a GGUF model; "
                              f"{model!r} is a {source.kind} directory")


def run_questions(llm: LLM, questions: Sequence[Question], methods: Sequence[Method], max_new_tokens: int,
                  temperature: float = 0.0, seed: int | None = None, device: str = "cpu",
                  others: OtherEngines = OtherEngines(), progress: bool = True,
                  traffic: Sequence[str] = ()) -> list[dict]:
    """Per question, every method back to back (the order rotating from question to question), after
    one warm-up run per method. Before that, each speculative quickdraft method answers `traffic`
    (chat turns, untimed) in its own scope: what its proposers share across requests (recycled
    candidates, earlier responses) is then a server's after that traffic. Returns one record per
    question with a `runs` entry per method."""
    _check_greedy_comparators(methods, temperature)
    check_schemas(questions, methods)
    n_ctx = llamacpp_context(llm, questions, max_new_tokens) if any(m.engine == "llama.cpp" for m in methods) else 0
    runners, closers = _runners(llm, methods, device, others, n_ctx)
    try:
        _serve_traffic(llm, [m for m in methods if m.spec is not None and m.spec.enabled], runners, traffic,
                       SamplingParams(max_new_tokens=max_new_tokens), progress)
        return _run(llm, questions, methods, runners, max_new_tokens, temperature, seed, progress)
    finally:
        for close in closers:
            close()


def _serve_traffic(llm: LLM, methods: Sequence[Method], runners: dict[str, TurnRunner], traffic: Sequence[str],
                   params: SamplingParams, progress: bool) -> None:
    bar = tqdm(total=len(traffic) * len(methods), unit="prompt", desc="traffic", file=sys.stderr,
               disable=not progress or not traffic, dynamic_ncols=True)
    for m in methods:
        with llm.shared_scope(m.label):
            for turn in traffic:
                run_conversation(llm, [turn], params, runners[m.label])
                bar.update()
    bar.close()


def _run(llm: LLM, questions: Sequence[Question], methods: Sequence[Method], runners: dict[str, TurnRunner],
         max_new_tokens: int, temperature: float, seed: int | None, progress: bool) -> list[dict]:
    warm = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=min(16, max_new_tokens))
    for m in methods:  # kernels built, draft models loaded, caches touched: none of it is timed
        with llm.shared_scope(("warm-up", m.label)):  # what a proposer learns here is not kept
            run_conversation(llm, questions[0].turns[:1], warm, runners[m.label], questions[0].chat,
                             questions[0].schema)  # the grammar's vocabulary built too (~1-2 s)
    greedy = temperature == 0
    results = []
    bar = tqdm(total=len(questions) * len(methods), unit="run", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    for i, q in enumerate(questions):
        # Every method of one question shares the seed; sampled outputs still differ by design.
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                seed=None if seed is None else seed + i)
        order = list(methods[i % len(methods):]) + list(methods[:i % len(methods)])
        turns: dict[str, list[dict]] = {}
        for m in order:
            bar.set_postfix_str(f"{q.group} #{q.question_id} {m.label}", refresh=False)
            with llm.shared_scope(m.label):  # state shared across requests: each method its own
                turns[m.label] = run_conversation(llm, q.turns, params, runners[m.label], q.chat, q.schema)
            bar.update()
        plain_ids = [t for r in turns[PLAIN] for t in r["token_ids"]] if greedy else None
        runs = {m.label: question_record(turns[m.label], plain_ids) for m in methods}
        results.append({"question_id": q.question_id, "category": q.category, "group": q.group,
                        "turns": len(q.turns), "runs": runs})
    bar.close()
    return results


def run_specbench(model: str | None, questions: Sequence[Question], methods: Sequence[Method],
                  max_new_tokens: int = 128, temperature: float = 0.0, seed: int | None = None,
                  device: str = "cpu", dtype: str = "float32", others: OtherEngines = OtherEngines(),
                  progress: bool = True, traffic: Sequence[str] = ()) -> tuple[LLM, list[dict]]:
    SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)  # validate first
    parse_dtype(dtype)
    _check_greedy_comparators(methods, temperature)
    check_schemas(questions, methods)
    check_llamacpp(model, methods)
    # every method answers the same questions: a prefix cache would time the later ones' prompts cached
    llm = load(model, device=device, dtype=dtype, prefix_cache_mb=0)
    for m in methods:  # load drafts and heads and check them before the first question, not during it
        if m.spec is not None and (m.spec.draft_model or m.spec.method == "draft"):
            llm.draft_model(m.spec.draft_model)
        if m.spec is not None and m.spec.head:  # (the model keeps every named head's layers from here)
            llm.draft_head(m.spec.head)
    return llm, run_questions(llm, questions, methods, max_new_tokens, temperature, seed, device, others, progress,
                              traffic)
