"""The text a draft head trains on: the target's own responses to conversation prompts, greedy
and, for more text than the prompts' greedy answers alone, sampled, kept as token ids with the
settings that made them (train/features.py rebuilds the target's features over them by prefill).

A head is used on the target's own output, so that is what it learns from (self-distillation, as
Medusa-2 does): ShareGPT's answers were written by other models, and a 135M target agrees with
their next token only about a third of the time, so features of that text teach a head what the
target would *not* say. Tokens are a few MB (gzip'd JSON) where features are hundreds: they are
what is kept, and they are saved every SHARD prompts, so a killed run's rerun generates only the
responses still missing.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.model.llama import Transformer
from quickdraft.proposers.identity import target_probe
from quickdraft.spec.sampling import SamplingParams

RESPONSES = "responses.json.gz"  # the greedy answers; sampled_file(r) round r's sampled ones
SHARD = 64  # responses saved together: what a killed run loses at most, besides those running


@dataclass(frozen=True)
class Response:
    tokens: list[int]  # s_0 .. s_n: prompt and response (a stop token ends it, not part of it)
    prompt_len: int    # s_0 .. s_{prompt_len-1} are the prompt


def sampled_file(round_: int) -> str:
    """The file of the r-th round of sampled answers (r >= 1), beside the greedy ones' RESPONSES."""
    return f"responses-sampled-{round_}.json.gz"


def target_settings(target: Transformer) -> dict:
    """What the target's output depends on besides its input: its weights as run and its dtype."""
    return {"target_probe": target_probe(target), "weights": target.weight_format, "dtype": str(target.compute_dtype)}


def save_responses(path: Path, settings: dict, responses: Sequence[Response]) -> None:
    """Written whole and renamed into place: a run killed while writing leaves the last file."""
    text = json.dumps({"settings": settings, "responses": [{"prompt_len": r.prompt_len, "tokens": r.tokens}
                                                           for r in responses]}, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(gzip.compress(text.encode(), compresslevel=6, mtime=0))
    os.replace(partial, path)


def load_responses(path: Path, settings: dict, prompts: Sequence[list[int]]) -> list[Response]:
    """The responses saved at `path` to the first of `prompts` ([] where there is no file); a file
    made with other settings or to other prompts is an error rather than overwritten."""
    if not path.is_file():
        return []
    saved = json.loads(gzip.decompress(path.read_bytes()))
    responses = [Response(r["tokens"], r["prompt_len"]) for r in saved["responses"]][:len(prompts)]
    if saved["settings"] != settings:
        # the probe's floats would tell a reader nothing
        theirs, ours = ({k: v for k, v in d.items() if k != "target_probe"} for d in (saved["settings"], settings))
        raise ValueError(f"{path} holds responses of another target or made with other settings (saved: {theirs}; "
                         f"this run: {ours}); use another --out or delete it")
    differ = next((i for i, (r, p) in enumerate(zip(responses, prompts)) if r.tokens[:r.prompt_len] != p), None)
    if differ is not None:
        raise ValueError(f"{path} holds responses to other prompts (prompt {differ} differs: other data flags); "
                         f"use another --out or delete it")
    return responses


def generate_responses(target: Transformer, prompts: Sequence[list[int]], eos_token_ids: frozenset[int],
                       max_new_tokens: int, path: Path, batch_size: int = 32, progress: bool = True,
                       shard: int = SHARD, temperature: float = 0.0, seed: int = 0) -> list[Response]:
    """Responses to `prompts` (batched, plain decoding), in prompt order: those saved at `path` and
    the rest, generated and saved there in order every `shard` prompts. Greedy, or sampled at
    `temperature` with prompt i's generator seeded by (seed, i): a seeded row's tokens do not depend
    on the rows beside it (engine/batch.py), so a killed run's rerun makes the same answers."""
    settings = {**target_settings(target), "max_new_tokens": max_new_tokens, "stop": sorted(eos_token_ids),
                **({"temperature": temperature, "seed": seed} if temperature else {})}
    done = load_responses(path, settings, prompts)
    todo = range(len(done), len(prompts))
    if not todo:
        return done
    engine = Engine(target, EngineConfig(max_batch=batch_size,
                                         max_seq_len=max(len(prompts[i]) for i in todo) + max_new_tokens))
    for i in todo:
        params = SamplingParams(temperature=temperature, seed=(seed << 32) + i if temperature else None,
                                max_new_tokens=max_new_tokens)
        engine.add(Request(list(prompts[i]), params, eos_token_ids, id=str(i)))
    bar_name = "responses" if not temperature else f"sampled {seed}"
    new: dict[int, list[int]] = {i: [] for i in todo}
    finished: set[int] = set()
    bar = tqdm(total=len(prompts), initial=len(done), desc=bar_name, unit="resp", disable=not progress)
    while engine.has_work():
        for request_id, event in engine.step():
            if event.error is not None:
                raise event.error
            new[int(request_id)].extend(event.token_ids)
            if event.finish_reason is not None:
                finished.add(int(request_id))
                bar.update(1)
        # rows finish out of order: a shard is saved once all of its prompts are answered
        while len(done) < len(prompts):
            next_shard = range(len(done), min(len(done) + shard, len(prompts)))
            if not finished.issuperset(next_shard):
                break
            done += [Response(list(prompts[i]) + new.pop(i), len(prompts[i])) for i in next_shard]
            save_responses(path, settings, done)
    bar.close()
    return done
