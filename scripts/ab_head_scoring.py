"""A/B of verification that stops scoring at the first rejection (issue 47, item 4), in one process.

A scores every fed position with the LM head (each row's first block is all of it), B scores as far
as the walk reaches (engine/scores.py); the two alternate per Spec-Bench question (A B, then B A),
greedy, every output compared. Prints each question's A/B time and the median, and the LM head's
scored positions in each arm (what B saves). The engine is the API's, its step costs measured at
start-up as `quickdraft serve` does.

    python scripts/ab_head_scoring.py --model smollm2-135m --method ngram --policy fixed
"""
from __future__ import annotations

import argparse
import statistics
import time

import quickdraft  # first: it sets OMP_WAIT_POLICY before torch loads, as the CLI does
from quickdraft.bench.questions import SPEC_BENCH_GROUPS, load_questions, resolve_questions_path, select_questions
from quickdraft.engine.scheduler import EngineConfig, Scheduler
from quickdraft.engine.startup import set_threads, startup_cost
from quickdraft.proposers.base import SpecConfig
from quickdraft.spec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--policy", choices=("goodput", "fixed"), default="goodput")
    parser.add_argument("--limit", type=int, default=2, help="questions per Spec-Bench group")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    llm = quickdraft.load(args.model, prefix_cache_mb=0)
    llm.engine_service(EngineConfig(policy=args.policy), startup_cost(llm, "goodput", True))
    head, scored = llm.model.logits, [0]

    def counting(features):
        scored[0] += features[..., 0].numel()
        return head(features)

    llm.model.logits = counting
    first = Scheduler._scored
    arms = {"A": lambda self, row, n: 1 + n, "B": first}
    spec, params = SpecConfig(method=args.method, k=args.k), SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                           ignore_eos=True)
    questions = [q for q in select_questions(load_questions(resolve_questions_path(None)), list(SPEC_BENCH_GROUPS), args.limit)
                 if q.chat and q.schema is None]
    llm.generate(messages=[{"role": "user", "content": "Hello"}], params=params, spec=spec)  # warm-up
    ratios, rows = [], {"A": 0, "B": 0}
    for i, question in enumerate(questions):
        messages = [{"role": "user", "content": question.turns[0]}]
        seconds, texts = {}, {}
        for arm in ("A", "B") if i % 2 == 0 else ("B", "A"):
            Scheduler._scored = arms[arm]
            scored[0] = 0
            start = time.perf_counter()
            texts[arm] = llm.generate(messages=messages, params=params, spec=spec).text
            seconds[arm] = time.perf_counter() - start
            rows[arm] += scored[0]
        Scheduler._scored = first
        if texts["A"] != texts["B"]:
            raise SystemExit(f"FAILURE: the arms' outputs differ on question {question.question_id}")
        ratios.append(seconds["A"] / seconds["B"])
        print(f"{question.category:>18} {question.question_id}: A {seconds['A']:.2f} s, B {seconds['B']:.2f} s, "
              f"A/B {ratios[-1]:.3f}", flush=True)
    print(f"{args.model} {args.method} k={args.k} {args.policy}: median A/B time {statistics.median(ratios):.3f} "
          f"over {len(ratios)} questions (> 1: B faster); LM head positions A {rows['A']}, B {rows['B']} "
          f"({rows['B'] / rows['A']:.2f}); every output identical")


if __name__ == "__main__":
    main()
