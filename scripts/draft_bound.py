"""What speculation can reach with the drafters we have: proposers replayed on plain greedy outputs
under the engine's policy, and an oracle over them.

Greedy speculative decoding emits plain greedy decoding's tokens, so a proposer can be scored
against them without running the target again: each step it drafts, the engine's policy
(engine/policy.py) picks how many tokens to verify from the draft's estimates and the step-cost
curve, the tokens that agree with the output are committed, and the proposer is told so, as the
engine tells it. The oracle takes, each step, the best of the proposers' drafts and verifies exactly
the tokens that will be accepted: no choice among these drafters and no verification policy can
beat it. Step time: each turn's plain step as its plain run measured it (decode time per token),
plus what the verified tokens add to a pass, t(1 + verified) - t(1) on `bench forward-cost`'s curve
measured here at context 256 (at a longer context they add more: an optimistic price, as a bound
wants); speedup = plain time / speculative time.

    python scripts/draft_bound.py -m smollm2-135m --source heldout --prompts 64
    python scripts/draft_bound.py -m smollm2-135m --source mt_bench,translation,summarization,qa,math_reasoning,rag,code_edit --limit 5
    python scripts/draft_bound.py -m qwen2.5-coder-1.5b --source humaneval --limit 82

Proposers that draft chains from the committed tokens alone (ngram, store, lookup-store): a head
reads the target's features, a draft model runs forwards, neither of which a replay has.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from itertools import accumulate
from pathlib import Path
from typing import Sequence

import quickdraft
from quickdraft import SamplingParams, SpecConfig
from quickdraft.engine.startup import set_threads

CONTEXT = 256  # the forward-cost curve's context
REPEATS = 15   # its rounds (medians): 5 left dips of a third on a 2-core VM


def truths(llm: quickdraft.LLM, source: str, prompts: int, limit: int, n: int) -> list[dict]:
    """Plain greedy answers, per turn: {group, prompt ids, answer ids, decode seconds}."""
    from quickdraft.bench.questions import bench_questions, parse_groups, select_questions
    from quickdraft.bench.specbench import run_conversation
    from quickdraft.train.data import held_out_prompts
    plain, params, out = SpecConfig("none"), SamplingParams(max_new_tokens=n), []

    def turn(group: str, prompt: str | list) -> dict:
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        ids = llm.prompt_ids(messages=prompt) if chat else llm.prompt_ids(prompt) if isinstance(prompt, str) else prompt
        r = llm.generate(ids, params=params, spec=plain)
        out.append({"group": group, "prompt": ids, "answer": r.token_ids, "decode_s": r.stats.total_s - r.stats.ttft_s})
        print(f"  {len(out)} {group}: {len(ids)} + {len(r.token_ids)} tokens", flush=True)
        return {"text": r.text}

    if source == "heldout":
        for ids in held_out_prompts(llm.tokenizer, prompts):
            turn("heldout", ids)
        return out
    groups = parse_groups(source)
    for q in select_questions(bench_questions(groups, None)[0], groups, limit):
        run_conversation(llm, q.turns, params, lambda p, _params, _schema, g=q.group: turn(g, p), chat=q.chat)
    return out


def replay(llm: quickdraft.LLM, methods: Sequence[str], data: Sequence[dict], k: int, t_ms: dict[int, float]
           ) -> dict[str, dict]:
    """Each method under the engine's policy, and the oracle over them: {name: speedup, tokens a pass}."""
    from quickdraft.engine.policy import RowDraft, StepCost, choose_draft_lengths
    from quickdraft.spec.draft_contract import Committed
    from quickdraft.spec.sequences import common_prefix

    def t(q: int) -> float:  # ms of a step feeding q tokens (the curve's last slope past its end)
        top = max(t_ms)
        return t_ms[q] if q in t_ms else t_ms[top] + (q - top) * (t_ms[top] - t_ms[top - 1])
    params, result = SamplingParams(max_new_tokens=1), {}
    for name in [*methods, "oracle"]:
        tokens = passes = 0
        spec_ms = plain_ms = 0.0
        for ex in data:
            prompt, answer = ex["prompt"], ex["answer"]
            plain_step = 1000 * ex["decode_s"] / (len(answer) - 1)  # ms
            proposers = [llm.proposer(prompt, params, SpecConfig(m, k=k)) for m in (methods if name == "oracle" else [name])]
            cost = StepCost()
            cost.seed({q: t(q) / 1000 for q in range(1, k + 2)})
            for p in proposers:
                p.commit(Committed(answer[:1], 0, 0, None))
            at = 1
            while at < len(answer):
                drafts = [p.propose(k) for p in proposers]
                if any(not d.is_chain for d in drafts):
                    raise SystemExit(f"{name} drafted a tree: the replay scores chains")
                reach = [common_prefix(d.tokens, answer[at:]) for d in drafts]
                if name == "oracle":  # the best draft, verified exactly as far as it is accepted
                    verified = accepted = max(reach)
                    told = [(0, 0)] * len(drafts)
                else:
                    draft = drafts[0]
                    verified = choose_draft_lengths([RowDraft.of(draft, False)], cost)[0] if draft.tokens else 0
                    accepted = min(verified, reach[0])
                    told = [(accepted, verified)]
                step = answer[at:at + accepted + 1]
                step_ms = plain_step + t(1 + verified) - t(1)
                spec_ms += step_ms
                plain_ms += plain_step * len(step)
                cost.observe(1 + verified, step_ms / 1000)
                for p, (drafted, seen) in zip(proposers, told):
                    p.commit(Committed(list(step), min(drafted, len(step)), seen, None))
                at += len(step)
                tokens += len(step)
                passes += 1
        result[name] = {"speedup": round(plain_ms / spec_ms, 3), "tokens_per_pass": round(tokens / passes, 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("--source", default="heldout", help="heldout, or bench groups (comma-separated)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out openings (--source heldout)")
    parser.add_argument("--limit", type=int, default=5, help="questions per group (bench groups)")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--methods", default="ngram,store,lookup-store")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--answers", type=Path, help="a JSON file of plain answers: read if it exists, else written")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    set_threads(args.threads)
    from quickdraft.engine.cost import measure_forward_cost
    llm = quickdraft.load(args.model, prefix_cache_mb=0)
    if args.answers and args.answers.exists():
        data = json.loads(args.answers.read_text())
    else:
        print(f"plain greedy answers ({args.source}) ...", flush=True)
        data = truths(llm, args.source, args.prompts, args.limit, args.max_new_tokens)
        if args.answers:
            args.answers.write_text(json.dumps(data))
    cost = measure_forward_cost(llm.model, range(1, args.k + 2), CONTEXT, repeats=REPEATS)
    # never falling as q grows (a dip is noise: engine/policy.py's rule)
    t_ms = dict(zip(sorted(cost.median_s), accumulate((1000 * cost.median_s[q] for q in sorted(cost.median_s)), max)))
    methods = args.methods.split(",")
    by_group: dict[str, list[dict]] = defaultdict(list)
    for ex in data:
        if len(ex["answer"]) > 1:  # a turn of one token decodes nothing
            by_group[ex["group"]].append(ex)
    if len(by_group) > 1:
        by_group["all"] = list(data)
    table = {g: replay(llm, methods, exs, args.k, t_ms) for g, exs in by_group.items()}
    plain_ms = statistics.median(1000 * ex["decode_s"] / (len(ex["answer"]) - 1) for ex in by_group[next(iter(by_group))])
    if args.json:
        print(json.dumps({"model": args.model, "t_ms": t_ms, "groups": table}))
        return
    print(f"{args.model}: t(q) ms at context {CONTEXT}: " + ", ".join(f"{q}: {v:.1f}" for q, v in t_ms.items())
          + f"; a plain step {plain_ms:.1f} ms (median of the first group's turns)")
    print("| group | turns | " + " | ".join([*methods, "oracle"]) + " |")
    print("|---|---:|" + "---:|" * (len(methods) + 1))
    for g, row in table.items():
        print(f"| {g} | {len(by_group[g])} | " + " | ".join(f"{r['speedup']:.2f}x ({r['tokens_per_pass']:.2f})"
                                                           for r in row.values()) + " |")


if __name__ == "__main__":
    main()
