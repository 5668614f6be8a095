"""The GPU check (issue 34): quickdraft's exactness and speed on CUDA in one bounded run.

`bash scripts/gpu_check.sh OUTDIR` writes OUTDIR/gpu_check.json, rewritten after every case (a run
cut short keeps what it measured), and OUTDIR/gpu_check.log (progress, and each failure's
traceback; a failing section is recorded and the next one runs). On CUDA: the tests' tiny random
models in float32, three of them mixtures of experts (logits against transformers', the HF-directory
and GGUF loaders, every registered proposer with chains and trees in batch 1 and in a batch rows join and leave, the
sampling law through the engine, cached prefixes with chunked prefill, a chat through the prefix
cache, a JSON schema's grammar and the sampling surface under speculation: gpu_features.py; a draft
head's training steps fusing two layers in the dtype `auto` picks, and a run resumed after a kill:
gpu_training.py), then a random Qwen2.5-1.5B-shaped model in bfloat16 timed against transformers' `generate` (speed.py). `--tiny`, or a machine without CUDA, runs the same
code on CPU with tiny shapes (tests/test_gpu_check.py). The models and oracles are the tests'.
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]


@dataclass(frozen=True)
class Scale:
    models: tuple[str, ...]   # tiny model names (tests/tiny_models.py)
    ks: tuple[int, ...]       # draft tokens (tree nodes) per step
    moe: tuple[str, ...]      # tiny mixtures of experts: parity, and exactness at moe_k only
    moe_k: int
    alone: tuple[int, ...]    # test_batch_engine.JOBS each run alone (batch 1)
    sampling: tuple[str, ...]  # sampling-law cases
    budget_s: float           # the whole run; cases past a section's share are recorded as skipped


FULL = Scale(("llama-gqa-untied", "qwen2-qkv-bias"), (2, 8), ("qwen3moe", "mixtral", "gptoss"), 4, (1, 4),
             ("batch-draft", "alone-draft-topp0.9", "batch-ngram"), 480.0)
TINY = Scale(("llama-gqa-untied",), (4,), ("mixtral",), 2, (1,), ("batch-ngram",), 150.0)
CHECKED = ("parity", "api", "exactness", "sampling", "features", "training")  # sections whose cases are pass/fail checks
SHARES = {"exactness": 0.5, "sampling": 0.2}  # of the budget, at most
DRAFT_VOCAB = 64  # the draft proposers' vocabulary: 64 of the tiny models' 96 tokens (draft_vocab.py)
ALPHA = 1e-6      # the tests' chi-square false-failure probability (test_verify.py)


class Report:
    """The JSON and the log of one run: every record is written at once."""

    def __init__(self, out: Path, mode: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.log = out / "gpu_check.json", (out / "gpu_check.log").open("a")
        self.data: dict[str, Any] = {**mode, "sections": {}}
        self.save()

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def put(self, section: str, key: str, value: Any) -> None:
        self.data["sections"].setdefault(section, {})[key] = value
        self.save()

    def add(self, section: str, case: dict[str, Any]) -> None:
        self.data["sections"].setdefault(section, {}).setdefault("cases", []).append(case)
        self.say(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in case.items() if k != "detail"))
        if case.get("detail"):
            self.say(f"    detail: {json.dumps(case['detail'], default=str)}")
        self.save()

    def save(self) -> None:
        checked = [s for name, s in self.data["sections"].items() if name in CHECKED]
        cases = [c for s in checked for c in s.get("cases", [])]
        self.data["skipped"] = sum("skipped" in c for c in cases)  # cases left out for time: not checked
        self.data["ok"] = bool(checked) and all("error" not in s for s in checked) and \
            all(c.get("ok") or "skipped" in c for c in cases)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def section(report: Report, name: str, run: Callable[[], None]) -> None:
    report.say(f"== {name}")
    t0 = time.perf_counter()
    try:
        run()
    except Exception:  # noqa: BLE001 - recorded with its traceback; the next section still runs
        report.say(traceback.format_exc())
        report.put(name, "error", traceback.format_exc())
    report.put(name, "seconds", round(time.perf_counter() - t0, 2))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def case(report: Report, name: str, fields: dict[str, Any], check: Callable[[], dict[str, Any]]) -> None:
    """One case of a section: its record, or the exception it raised (the section goes on)."""
    try:
        report.add(name, {**fields, **check()})
    except Exception as e:  # noqa: BLE001 - recorded with its traceback
        report.add(name, {**fields, "ok": False, "error": repr(e), "detail": traceback.format_exc()})


def environment(device: str) -> dict[str, Any]:
    import transformers

    from quickdraft.kernels import kernel_info
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "kernel": kernel_info().as_dict()}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                   cuda=torch.version.cuda, tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return env


# -- exactness: tiny float32 models, the tests' oracles -------------------------------------------------------

class Home:
    """A proposer factory's Target (proposers/base.py) around a tiny model: its draft model (the
    target with noise: right part of the time), its draft head (test_head.identity_head: loops
    accepted), its datastore (own_datastore) and the state its requests share, as quickdraft.LLM
    keeps them."""
    name = None  # loaded from no packaged name
    prefix = None  # no prefix cache (nor then a draft's): each case decodes from scratch
    tokenizer = SimpleNamespace(hf=SimpleNamespace(added_tokens_decoder={}), eos_token_ids=(2,))  # draft_vocab.py

    def __init__(self, model_name: str, device: str) -> None:
        from quickdraft.proposers.head import on_target
        from support.models import tiny
        from test_head import identity_head
        from test_lookup_draft import noisy
        self.model_name, self.model = model_name, tiny(model_name, init=0.1, device=device)
        self.draft = noisy(model_name, 0.3, device)
        self.head = on_target(identity_head(self.model), self.model).requires_grad_(False).eval()
        self.state: dict[Any, Any] = {}

    def draft_model(self, name_or_path: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(model=self.draft, tokenizer=self.tokenizer)

    def draft_head(self, path: str | None = None) -> Any:
        return self.head

    def datastore(self, path: str | None = None) -> Any:
        return own_datastore(self.model_name, str(self.model.device))

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.state:
            self.state[key] = make()
        return self.state[key]


@functools.lru_cache(maxsize=None)
def own_datastore(model_name: str, device: str) -> Any:
    """A datastore of the tiny model's own greedy answers to the exactness jobs' prompts and to as
    many random ones: its drafts are accepted often, and not always."""
    from quickdraft.proposers.datastore import Datastore
    from quickdraft.train.responses import generate_responses
    from support.engine import JOBS
    from support.models import tiny
    g = torch.Generator().manual_seed(3)
    prompts = [list(job.prompt) for job in JOBS] + [torch.randint(3, 96, (6,), generator=g).tolist() for _ in JOBS]
    with tempfile.TemporaryDirectory() as tmp:
        answers = generate_responses(tiny(model_name, init=0.1, device=device), prompts, frozenset(), 40,
                                     Path(tmp) / "answers.json.gz", batch_size=8, progress=False)
    docs = [r.tokens[r.prompt_len:] for r in answers]
    return Datastore(np.array([t for d in docs for t in d]), np.array([len(d) for d in docs]))


def divergence(model: Any, prompt: list[int], ref: list[int], got: list[int]) -> dict[str, Any]:
    """Where greedy output left plain decoding's, and the plain logits' top-2 gap there (a gap near
    float32's rounding is a numerical tie between two kernels, not a logic error)."""
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    ids = prompt + ref[:i]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device)[None],
                       model.new_cache(1, len(ids)), last_n=1).logits[0, -1].float()
    top = logits.topk(2).values.tolist()
    return {"index": i, "plain": ref[i:i + 3], "spec": got[i:i + 3], "top2_gap": top[0] - top[1]}


def exact_case(method: str, model_name: str, k: int, batched: bool, device: str, plain: dict) -> dict[str, Any]:
    """Every job's greedy tokens with `method` against the job decoded plainly alone (3 rows for 7
    requests: rows join, finish (one on a stop token) and wait; one row decodes plainly)."""
    from quickdraft.engine.batch import EngineConfig
    from quickdraft.proposers import PROPOSERS, ProposerContext, SpecConfig
    from support.engine import JOBS, run_batched
    home = Home(model_name, device)
    spec = SpecConfig(method, k=k, options={"draft_vocab": DRAFT_VOCAB})

    def make(prompt: list[int], params: Any) -> Any:
        return PROPOSERS[method].factory(ProposerContext(list(prompt), params, spec, home))

    if batched:
        jobs = [JOBS[0], *(replace(job, make=make, k=k) for job in JOBS[1:])]
        runs = [(list(range(len(jobs))), run_batched(home.model, jobs, EngineConfig(max_batch=3, policy="fixed"),
                                                     check_kv=False))]
    else:
        jobs = [replace(JOBS[i], make=make, k=k, join_at=0) for i in plain["alone"]]
        runs = [([i], run_batched(home.model, [job], EngineConfig(max_batch=1, policy="fixed"), check_kv=False))
                for i, job in zip(plain["alone"], jobs)]
    bad, drafted, accepted = [], 0, 0
    for indices, (out, last, violations) in runs:
        bad += violations
        for rid, i in enumerate(indices):
            got, ref = out[str(rid)], plain[(model_name, i)]
            drafted += last[str(rid)].stats.drafted_tokens
            accepted += last[str(rid)].stats.accepted_tokens
            if last[str(rid)].finish_reason == "error":  # a proposer's or a pass's exception ended it
                bad.append({"job": i, "error": repr(last[str(rid)].error)})
            elif got != ref:
                bad.append({"job": i, **divergence(home.model, JOBS[i].prompt, ref, got)})
    return {"ok": not bad and drafted > 0, "drafted": drafted,
            "acceptance": round(accepted / drafted, 3) if drafted else None, "detail": bad}


def exactness(report: Report, scale: Scale, device: str, deadline: float) -> None:
    """Greedy speculative == plain for every registered proposer, model and k, alone and batched."""
    from quickdraft.proposers import PROPOSERS
    from support.engine import JOBS
    from support.models import tiny
    plain: dict[Any, Any] = {"alone": scale.alone}
    for name in scale.models + scale.moe:
        model = tiny(name, init=0.1, device=device)
        for i, job in enumerate(JOBS):
            plain[(name, i)] = replace(job, make=None, k=0).alone(model)
        report.put("exactness", f"plain_{name}_distinct_tokens", len(set(plain[(name, 1)])))
    runs = [*itertools.product(scale.models, scale.ks), *((name, scale.moe_k) for name in scale.moe)]
    for name, k in runs:                  # every method per (model, k): a run cut short for time has
        for method in sorted(PROPOSERS):  # run each method
            for batched in (False, True):
                fields = {"method": method, "model": name, "k": k, "batch": 3 if batched else 1}
                if time.perf_counter() > deadline:
                    report.add("exactness", {**fields, "skipped": "out of time"})
                    continue
                case(report, "exactness", fields,
                     lambda: exact_case(method, name, k, batched, device, plain))  # noqa: B023 - called at once


def parity(report: Report, scale: Scale, device: str) -> None:
    """Our logits against transformers' on the same tiny weights, on the device (float32)."""
    from support.models import tiny
    from test_spec_exactness import PROMPT_REPEAT
    from tiny_models import hf_model
    for name in scale.models + scale.moe:
        hf = hf_model(name, seed=0, initializer_range=0.1).to(device)
        ours = tiny(name, init=0.1, device=device)
        ids = torch.tensor([PROMPT_REPEAT], device=device)
        with torch.inference_mode():
            theirs = hf(ids).logits[0].float()
            mine = ours(ids, torch.arange(ids.shape[1], device=device)[None], ours.new_cache(1, ids.shape[1])).logits[0]
        diff = float((mine.float() - theirs).abs().max())
        report.add("parity", {"model": name, "max_abs_diff": diff, "ok": diff <= 1e-4})


def sampling(report: Report, scale: Scale, device: str, deadline: float) -> None:
    """The first sampled tokens follow plain sampling's law (chi-square at ALPHA, the law computed
    on CPU from the same weights); the same counts against another temperature must be rejected."""
    from quickdraft.spec.sampling import SamplingParams
    from support.laws import N_TOKENS, PROMPT16, chi_square_p_value, plain_law
    from support.models import tiny16
    from test_batch_engine import sampled_in_batches
    from test_spec_exactness import sampled_counts
    law, other = (plain_law(tiny16(), PROMPT16, SamplingParams(temperature=t, top_p=p), N_TOKENS)
                  for t, p in ((1.0, 1.0), (0.75, 1.0)))
    law_topp = plain_law(tiny16(), PROMPT16, SamplingParams(temperature=1.0, top_p=0.9), N_TOKENS)

    def check(name: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        if name.startswith("batch-"):
            counts, drafted, accepted = sampled_in_batches(name.removeprefix("batch-"), device)
            expected = law
        else:  # alone-draft-topp0.9: one request at a time (test_spec_exactness's seeds)
            counts, drafted, accepted = sampled_counts("draft", SamplingParams(temperature=1.0, top_p=0.9),
                                                       10_000, device)
            expected = law_topp
        p, control = chi_square_p_value(counts, expected), chi_square_p_value(counts, other)
        impossible = int(counts[expected == 0].sum())
        return {"samples": int(counts.sum()), "drafted": drafted, "accepted": accepted, "p_value": p,
                "control_p_value": control, "impossible_draws": impossible,
                "ok": 0 < accepted < drafted and impossible == 0 and p > ALPHA and control < ALPHA,
                "seconds": round(time.perf_counter() - t0, 2)}

    for name in scale.sampling:
        if time.perf_counter() > deadline:
            report.add("sampling", {"case": name, "skipped": "out of time"})
            continue
        case(report, "sampling", {"case": name}, lambda: check(name))  # noqa: B023 - called at once


def api(report: Report, device: str, tmp: Path) -> None:
    """quickdraft.load onto the device from an HF directory and a GGUF file, generation through
    LLM.generate with speculation, and a draft head loaded for a bfloat16 target."""
    import quickdraft
    from quickdraft import SamplingParams, SpecConfig
    from quickdraft.engine.loop import generate_tokens
    from quickdraft.model.build import build_transformer
    from quickdraft.model.rope import inverse_frequencies
    from quickdraft.proposers.head import load_head, save_head
    from quickdraft.weights.gguf_file import read_gguf
    from support.heads import random_head
    from tiny_tokenizer import tiny_llm_dir, tiny_model, write_llama_gguf
    path = tiny_llm_dir(tmp / "model")
    llm = quickdraft.load(path, device=device)
    params, prompt = SamplingParams(max_new_tokens=24, ignore_eos=True), "hello hello 中文 hello"
    plain = llm.generate(prompt, params=params)

    def speculative(spec: SpecConfig) -> dict[str, Any]:
        out = llm.generate(prompt, params=params, spec=spec)
        return {"drafted": out.stats.drafted_tokens, "ok": out.token_ids == plain.token_ids and
                out.text == plain.text and out.stats.drafted_tokens > 0}

    for method in ("ngram", "draft", "draft-tree"):  # the draft model: the target itself, loaded again
        case(report, "api", {"load": "hf-dir", "spec": method},
             lambda: speculative(SpecConfig(method, k=4, draft_model=str(path), adaptive=False)))  # noqa: B023

    def gguf_weights() -> dict[str, Any]:  # the weights only: the GGUF tokenizer needs transformers >= 5.23
        ckpt = read_gguf(write_llama_gguf(tiny_model(), tmp / "model.gguf"), quantized=device == "cpu")
        model = build_transformer(ckpt.config, ckpt.tensors, device=device, rope_freq_factors=ckpt.rope_freq_factors)
        ids = [t for e in generate_tokens(model, llm.prompt_ids(prompt), params) for t in e.token_ids]
        return {"ok": ids == plain.token_ids}

    case(report, "api", {"load": "gguf"}, gguf_weights)
    bf16 = quickdraft.load(path, device=device, dtype="bfloat16")

    def head_frequencies() -> dict[str, Any]:
        head = load_head(save_head(random_head(bf16.model), bf16.model, tmp / "head", "tiny"), bf16.model)
        return {"ok": head.inv_freq.dtype == torch.float32 and
                torch.equal(head.inv_freq.cpu(), inverse_frequencies(head.config))}

    case(report, "api", {"head": "bfloat16 target"}, head_frequencies)
    # information, not a check: in bfloat16 on CUDA a k+1-token pass may round unlike a 1-token one
    bf_spec = bf16.generate(prompt, params=params, spec=SpecConfig("ngram", k=4, adaptive=False)).token_ids
    report.put("api", "bfloat16_ngram_equals_plain", bf_spec == bf16.generate(prompt, params=params).token_ids)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (the default without CUDA)")
    args = parser.parse_args(argv)
    tiny_run = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny_run else "cuda"
    if device == "cuda":  # CUDA tensors never reach the C kernels: skip compiling them (~1 min)
        os.environ.setdefault("QUICKDRAFT_KERNEL", "torch")
    import gpu_features
    import gpu_speed as speed
    import gpu_training
    scale = TINY if tiny_run else FULL
    start = time.perf_counter()
    report = Report(args.out, {"device": device, "tiny": tiny_run, "env": environment(device)})
    report.say(f"gpu_check on {device}: {json.dumps(report.data['env'])}")

    def until(share: float) -> float:
        return time.perf_counter() + share * scale.budget_s

    with tempfile.TemporaryDirectory() as tmp:
        section(report, "parity", lambda: parity(report, scale, device))
        section(report, "api", lambda: api(report, device, Path(tmp)))
        section(report, "features", lambda: gpu_features.run(report, device, Path(tmp), case))
        section(report, "training", lambda: gpu_training.run(report, device, Path(tmp), case))
    section(report, "exactness", lambda: exactness(report, scale, device, until(SHARES["exactness"])))
    section(report, "sampling", lambda: sampling(report, scale, device, until(SHARES["sampling"])))
    section(report, "speed", lambda: speed.run(report, speed.TINY if tiny_run else speed.FULL, device,
                                               start + scale.budget_s))
    report.data["seconds"] = round(time.perf_counter() - start, 1)
    report.say(f"== done in {time.perf_counter() - start:.0f} s: checks {'PASS' if report.data['ok'] else 'FAIL'}, "
               f"{report.data['skipped']} skipped for time")
    report.save()
    report.log.close()
    return report.data


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
