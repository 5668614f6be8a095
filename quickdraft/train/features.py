"""The target's features over its recorded responses (train/responses.py), rebuilt by prefill and
cached in the output folder: the training examples a head learns from.

A response's features are one forward of the target over it, one response at a time, so each is
the same in any batch and on any rerun. Where the target's passes are batch-invariant (a quantized
GGUF target on CPU at any length, float weights up to kernels.MAX_ROWS tokens) they are bitwise
the features the engine handed over while decoding the response; elsewhere (torch's GEMM, which
blocks its sums by the row count) they differ in the last bits of float32, far below bfloat16's,
in which they are kept. The cache is a file per SHARD responses, each keyed by the target, the layers
it keeps (Transformer.keep_features) and its responses' tokens, so a killed prefill resumes and changed responses recompute only their shard.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from quickdraft.model.llama import Transformer
from quickdraft.train.responses import SHARD, Response, target_settings

FEATURES = "features"          # the cache's folder in the output folder
STORE_DTYPE = torch.bfloat16   # half the bytes; its rounding is far below the head's error


@dataclass
class Example:
    tokens: list[int]          # s_0 .. s_n: prompt and response
    features: torch.Tensor     # [n, F] f_0 .. f_{n-1}: the target's features (its feature_layers' outputs, the
                               # last layer's last) at each token but the last
    prompt_len: int            # s_0 .. s_{prompt_len-1} are the prompt


@torch.inference_mode()
def prefill(target: Transformer, tokens: Sequence[int]) -> torch.Tensor:
    """[n, F] the target's features (Transformer.feature_layers) at s_0 .. s_{n-1} of tokens s_0 .. s_n
    (the last token's would predict past the response: no pair learns from it)."""
    ids = torch.tensor([list(tokens[:-1])], device=target.device)
    positions = torch.arange(ids.shape[1], device=target.device)[None]
    features = target(ids, positions, target.new_cache(1, ids.shape[1]), last_n=0).features[0]
    return features.to("cpu", STORE_DTYPE)


def shard_key(target: Transformer, responses: Sequence[Response]) -> str:
    """What a shard's features depend on: the target as run, the layers it keeps, its responses' tokens."""
    # (the last layer's alone: the key made before the layers could be chosen, so kept caches stay valid)
    layers = [] if target.feature_layers == (target.config.num_layers - 1,) else [list(target.feature_layers)]
    text = json.dumps([target_settings(target), [r.tokens for r in responses], *layers])
    return hashlib.sha256(text.encode()).hexdigest()


def _cached(path: Path, key: str) -> list[torch.Tensor] | None:
    if not path.is_file():
        return None
    # mapped, not read: a run's features (GBs) are then the page cache's, shared by the runs that
    # read one folder, and a step copies only its batch's
    saved = torch.load(path, weights_only=True, mmap=True)
    return saved["features"] if saved.get("key") == key else None


def training_examples(target: Transformer, responses: Sequence[Response], folder: Path, progress: bool = True,
                      shard: int = SHARD) -> list[Example]:
    """The responses with the target's features: cached in `folder` (a file per `shard` responses),
    or computed by prefill and cached there."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = [responses[i:i + shard] for i in range(0, len(responses), shard)]
    keys = [shard_key(target, s) for s in shards]
    features = [_cached(folder / f"{i:05d}.pt", key) for i, key in enumerate(keys)]
    tokens = [sum(len(r.tokens) - 1 for r in s) for s in shards]  # positions each shard's prefill runs
    bar = tqdm(total=sum(tokens), initial=sum(n for n, f in zip(tokens, features) if f is not None),
               desc="features", unit="tok", unit_scale=True, disable=not progress)
    for i, (key, s) in enumerate(zip(keys, shards)):
        if features[i] is None:
            features[i] = []
            for r in s:
                features[i].append(prefill(target, r.tokens))
                bar.update(len(r.tokens) - 1)
            partial = folder / f"{i:05d}.pt.partial"
            torch.save({"key": key, "features": features[i]}, partial)
            os.replace(partial, folder / f"{i:05d}.pt")  # whole or absent: a killed run recomputes the shard
            features[i] = _cached(folder / f"{i:05d}.pt", key)  # mapped as a kept shard is, its memory freed
    bar.close()
    return [Example(r.tokens, f, r.prompt_len) for s, fs in zip(shards, features) for r, f in zip(s, fs)]
