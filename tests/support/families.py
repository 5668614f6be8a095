"""A model family's greedy run through one engine (test_model_families')."""
from __future__ import annotations

from quickdraft import SamplingParams
from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.proposers import SpecConfig

N = 16
GREEDY = SamplingParams(max_new_tokens=N, ignore_eos=True)


def run_engine(llm, prompts: list[str], spec: SpecConfig) -> dict[str, list[int]]:
    """Every prompt a request of one engine of up to 3 rows, drafting with `spec`."""
    engine = Engine(llm.model, EngineConfig(max_batch=3, policy="fixed"))
    out: dict[str, list[int]] = {}
    for p in prompts:
        ids = llm.tokenizer.encode(p)
        engine.add(Request(ids, GREEDY, frozenset(), llm.proposer(ids, GREEDY, spec), spec.k, adaptive=False, id=p))
        out[p] = []
    steps = 0
    while engine.has_work():
        for rid, event in engine.step():
            out[rid] += event.token_ids
        steps += 1
        assert steps < 200
    return out
