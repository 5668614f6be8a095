"""The features half of the GPU check (gpu_check.py): what requests use beyond plain tokens, on the
device. Cached prefixes with chunked prefill in the engine (test_prefix_cache's sessions); through
quickdraft.load, a chat whose turns hit the prefix cache, a JSON schema's grammar and the sampling
surface, each greedy speculative output against plain decoding of the same model. On CUDA no pass
is batch-invariant (Transformer.invariant_rows), so these check outputs, not bits.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

Case = Callable[[Any, str, dict[str, Any], Callable[[], dict[str, Any]]], None]


def cached_prefixes(device: str, batch: int, chunk: int | None) -> dict[str, Any]:
    """test_prefix_cache's sessions (a shared system prompt, rows joining and leaving, prompt lookup
    and draft models) through one engine with a prefix cache, `chunk`-token prefill passes and
    `batch` rows: every request emits what it emits alone, uncached."""
    from quickdraft.engine.batch import Engine, EngineConfig
    from quickdraft.proposers.draft_model import DraftModelProposer
    from quickdraft.proposers.drafter import Drafter
    from support.engine import Job, drive, greedy, ngram
    from support.models import tiny
    from support.prefix import CONVERSATION, MODEL, prefix_for
    model = tiny(MODEL, init=0.1, device=device)
    drafters = {"draft_same": Drafter(model), "draft_random": Drafter(tiny(MODEL, seed=1, device=device))}

    def maker(name: str | None) -> Any:
        if name is None or name == "ngram":
            return name and ngram
        return lambda prompt, params: DraftModelProposer(drafters[name], prompt, params,
                                                         len(prompt) + params.max_new_tokens + 9)

    jobs = [Job(prompt, greedy(24), maker(name), k, join_at=at) for prompt, name, k, at in CONVERSATION]
    out, cached = drive(Engine(model, EngineConfig(max_batch=batch, prefill_chunk=chunk), prefix=prefix_for(model)),
                        jobs)
    differ = [i for i, job in enumerate(jobs) if out[str(i)] != job.alone(model)]
    hits = sum(cached[str(i)] for i in (3, 4, 6))
    return {"ok": not differ and hits >= 96, "cached_tokens": hits, "detail": differ}


def run(report: Any, device: str, tmp: Path, case: Case) -> None:
    """What requests use beyond plain tokens, on the device: cached prefixes with chunked prefill in
    the engine; through quickdraft.load, a chat whose turns hit the prefix cache, a JSON schema's
    grammar and the sampling surface (penalties, a logit bias, log-probabilities), each greedy
    speculative output against plain decoding of the same model. `case(report, section, fields,
    check)` records each (gpu_check.case)."""
    import quickdraft
    from quickdraft import SamplingParams, SpecConfig
    from tiny_tokenizer import tiny_llm_dir
    for batch, chunk in ((1, None), (3, None), (3, 5)):
        case(report, "features", {"case": "prefix cache", "batch": batch, "chunk": chunk},
             lambda: cached_prefixes(device, batch, chunk))  # noqa: B023 - called at once
    path = tiny_llm_dir(tmp / "chat", max_position_embeddings=2048)
    warm, cold = quickdraft.load(path, device=device), quickdraft.load(path, device=device, prefix_cache_mb=0)
    specs = {"plain": SpecConfig("none"), "ngram": SpecConfig("ngram", k=4, adaptive=False),
             "draft": SpecConfig("draft", k=3, draft_model=str(path), adaptive=False)}

    def chat(method: str) -> dict[str, Any]:
        history: list[dict[str, str]] = []
        cached, differ, drafted = [], [], 0
        for turn, question in enumerate(("Tell me about the sea and the ships on it. " * 3, "And the harbours?",
                                         "Which is oldest?")):
            history.append({"role": "user", "content": question})
            params = SamplingParams(max_new_tokens=20, ignore_eos=True)
            got = warm.generate(messages=history, params=params, spec=specs[method])
            if got.token_ids != cold.generate(messages=history, params=params, spec=specs["plain"]).token_ids:
                differ.append(turn)
            cached.append(got.stats.cached_tokens)
            drafted += got.stats.drafted_tokens
            history.append({"role": "assistant", "content": got.text})
        return {"ok": not differ and all(n > 0 for n in cached[1:]), "cached_tokens": cached, "detail": differ,
                "drafted": drafted}

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    prompt = 'Answer in JSON like {"name":"Bob","age":7} please: '
    params = SamplingParams(max_new_tokens=40)
    constrained = cold.generate(prompt, params=params, spec=specs["plain"], response_format=fmt)

    def grammar(method: str) -> dict[str, Any]:
        got = cold.generate(prompt, params=params, spec=specs[method], response_format=fmt)
        value = json.loads(got.text)  # the plain and speculative texts alike must parse and fit the schema
        fits = set(value) == {"name", "age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        return {"ok": got.token_ids == constrained.token_ids and fits and
                (method == "plain") != (got.stats.drafted_tokens > 0), "drafted": got.stats.drafted_tokens,
                "text": got.text}

    # a negative presence penalty: the tiny model repeats itself, so prompt lookup has drafts to verify
    surface = SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=-0.6, frequency_penalty=0.2,
                             logit_bias={5: 2.0, 7: -3.0}, logprobs=3)
    repeated = "a b c a b c a b c a b c a b c"
    alone = cold.generate(repeated, params=surface, spec=specs["plain"])

    def sampling_surface(method: str) -> dict[str, Any]:
        got = cold.generate(repeated, params=surface, spec=specs[method])
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, alone.logprobs))
        return {"ok": got.token_ids == alone.token_ids and len(got.logprobs) == len(alone.logprobs) == 24
                and worst <= 1e-4 and (method == "plain") != (got.stats.drafted_tokens > 0),
                "drafted": got.stats.drafted_tokens, "logprob_max_diff": worst}

    for method in specs:
        case(report, "features", {"case": "chat, prefix cache", "spec": method}, lambda: chat(method))  # noqa: B023
        case(report, "features", {"case": "json schema", "spec": method}, lambda: grammar(method))  # noqa: B023
        case(report, "features", {"case": "penalties, bias, logprobs", "spec": method},
             lambda: sampling_surface(method))  # noqa: B023
