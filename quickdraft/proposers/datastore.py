"""A datastore of the target's own answers: draft what the target most often wrote after the
text's last words (retrieval drafting, as REST; here the store holds the target's own greedy answers
to chat prompts, so its phrasing is the target's).

The store is an n-gram table over those answers: for every context of 1..TABLE_N tokens seen in
them, the token that followed it most often (built once per target and process from the token ids
of a datastore file: quickdraft/datastores/ ships one per packaged target; `quickdraft
build-datastore` writes one from `train-head`'s answers). A draft extends the text token by token
with the follower of its longest known context, so a chain of k tokens costs k table lookups and
no model pass. Deterministic drafts (q one-hot): verification stays exact, greedy and sampled.

    answers:  ... [I hope this helps] [!] ...      context "this helps" -> "!" (seen 40 of 52 times)
    text:     ... "Let me know if this helps"      draft: "!", then the follower of "helps !", ...

`store` drafts from the table alone; `lookup-store` is the hybrid (hybrid.py) of prompt lookup, which
wins where the answer copies its prompt or itself, and the store elsewhere.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from quickdraft.model.llama import Transformer
from quickdraft.proposers.base import EACH, NO_DRAFT, Committed, Draft, ProposerContext, SpecConfigError, register
from quickdraft.proposers.identity import target_identity, trained_for
from quickdraft.proposers.registry import check_ranges, option
from quickdraft.spec.goodput import Acceptance

PACKAGED = Path(__file__).resolve().parents[1] / "datastores"  # one .npz per packaged target
FORMAT = "quickdraft-datastore-v1"
TABLE_N = 6  # the longest context the table holds (fixed: one table per target, whatever requests ask)
MULT = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the contexts' polynomial hash (collisions ~1e-6 at 10M keys)
MASK = (1 << 64) - 1


@dataclass(frozen=True)
class StoreOptions:
    store_min_n: int = option(1, "store, lookup-store: shortest context of the text's end looked up in the "
                                     "datastore", 1, TABLE_N)

    def __post_init__(self) -> None:
        check_ranges(self)


def save(path: Path, docs: Sequence[Sequence[int]], target: Transformer, about: dict) -> Path:
    """Write the target's answers `docs` (token ids) as a datastore file: the ids end to end in the
    smallest unsigned type that holds the vocabulary, each answer's length, and what it is for (the
    target's identity, as a head's head.json names it)."""
    vocab_size = target.config.vocab_size
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    tokens = np.fromiter((t for d in docs for t in d), dtype=dtype)
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    meta = json.dumps({"format": FORMAT, **target_identity(target), "answers": len(docs), **about})
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, tokens=tokens, lengths=lengths, meta=np.array(meta))
    return path


class Datastore:
    """Context hash -> the follower seen most often after it, and how often (of how many). Read-only
    once built: the requests of a target share one."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, max_n: int = TABLE_N) -> None:
        if (lengths < 0).any() or lengths.sum() != len(tokens):
            raise ValueError(f"a datastore's answer lengths must be >= 0 and sum to its {len(tokens)} tokens")
        self.max_n, self.size = max_n, len(tokens)
        tokens = tokens.astype(np.int64)
        position = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # within its answer
        # every (context of n tokens, follower) pair in one array each: filled order by order, in place,
        # as the build's memory is a few times these (~350 MB at SmolLM2's 1.28M tokens)
        seen = [position >= n for n in range(1, max_n + 1)]  # the n tokens before lie in the same answer
        key = np.empty(sum(int(m.sum()) for m in seen), dtype=np.uint64)
        follower = np.empty(len(key), dtype=np.int32)
        h, at = np.zeros(len(tokens), dtype=np.uint64), 0
        for n, mask in enumerate(seen, start=1):
            # the hash of the n tokens before each position, as `contexts` computes it for a text's end
            # (it wraps modulo 2**64, as MASK does there)
            h *= np.uint64(MULT)
            h[n:] += tokens[:-n].astype(np.uint64) + np.uint64(1)
            m = int(mask.sum())
            key[at:at + m], follower[at:at + m] = h[mask], tokens[mask]
            at += m
        del seen, h, position
        order = np.lexsort((follower, key))
        key, follower = key[order], follower[order]
        del order
        # runs of one (context, follower) pair, then per context the pair with the longest run
        # (the smallest token among equals: lexsort is stable)
        pair_start = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (follower[1:] != follower[:-1])])[:len(key)]
        pair_count = np.diff(np.r_[pair_start, len(key)])
        pair_key, pair_follower = key[pair_start], follower[pair_start]
        best = np.lexsort((-pair_count, pair_key))
        chosen = best[np.r_[True, pair_key[best][1:] != pair_key[best][:-1]][:len(best)]]
        self.keys = pair_key[chosen]                                  # sorted, unique
        self.follower = pair_follower[chosen]
        self.count = pair_count[chosen].astype(np.int32)
        context_start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])[:len(key)]
        self.total = np.diff(np.r_[context_start, len(key)]).astype(np.int32)  # the same contexts, same order

    def contexts(self, text: Sequence[int]) -> list[int]:
        """The hashes of the text's last 1..max_n tokens (as the table's are computed)."""
        out, h = [], 0
        for n in range(1, min(self.max_n, len(text)) + 1):
            h = (h * MULT + int(text[-n]) + 1) & MASK
            out.append(h)
        return out

    def chain(self, text: Sequence[int], k: int, min_n: int = 1) -> list[tuple[int, int, float]]:
        """Up to k (token, context length, its share of that context's followers): each token the
        most frequent follower of the longest context of min_n..max_n tokens known, the text
        extended by the tokens before it; it stops where no context is known."""
        text, out = list(text[-self.max_n:]), []
        for _ in range(k):
            found = self.contexts(text)
            where = np.searchsorted(self.keys, np.array(found, dtype=np.uint64))
            hit = next((n for n in range(len(found), min_n - 1, -1)
                        if where[n - 1] < len(self.keys) and int(self.keys[where[n - 1]]) == found[n - 1]), None)
            if hit is None:
                break
            i = int(where[hit - 1])
            token = int(self.follower[i])
            out.append((token, hit, int(self.count[i]) / int(self.total[i])))
            text = (text + [token])[-self.max_n:]
        return out


def _check_npz(path: Path) -> None:
    """A file that is no whole .npz is refused by what it should be (numpy's own message for a text
    file suggests loading pickles)."""
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        raise SpecConfigError(f"cannot read the datastore {path}: it is no whole .npz file (a datastore is "
                              f"the .npz that `quickdraft build-datastore` writes)")


def meta_of(path: Path) -> dict:
    """A datastore file's description (its tokens are not read)."""
    _check_npz(path)
    try:
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, AttributeError) as e:
        raise SpecConfigError(f"cannot read the datastore {path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SpecConfigError(f"{path} is not a quickdraft datastore ({FORMAT})")
    return meta


def find_datastore(path: str | Path | None, target: Transformer) -> Path:
    """The datastore file to use for `target`: the one named (checked to be for it), else the one
    that ships for it (quickdraft/datastores/); neither is a clear error. Reads no tokens."""
    if path:
        if not trained_for(meta_of(Path(path)), target):
            raise SpecConfigError(f"the datastore {path} holds another model's answers (its target's shape or "
                                  f"embeddings differ from this model's)")
        return Path(path)
    for shipped in sorted(PACKAGED.glob("*.npz")):
        if trained_for(meta_of(shipped), target):
            return shipped
    raise SpecConfigError("no datastore ships with quickdraft for this model; build one from the target's answers "
                          "with `quickdraft build-datastore` and pass it with --datastore FILE")


def load_datastore(path: Path, vocab_size: int) -> Datastore:
    """The table over a datastore file's answers (a few seconds for a million tokens); a file
    that is not one, or holds a token outside the vocabulary, is a clear error."""
    _check_npz(path)
    try:
        with np.load(path) as f:
            tokens, lengths = f["tokens"], f["lengths"]
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(f"it holds token {int(tokens.max())}, outside the model's {vocab_size}")
        return Datastore(tokens, lengths)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, AttributeError) as e:
        raise SpecConfigError(f"cannot read the datastore {path}: {e}") from None


def share_bucket(share: float) -> int:
    """The per-request agreement tables' bucket for a follower's share of its context (quarters)."""
    return min(3, int(share * 4))


class StoreProposer:
    """Draft a chain from the datastore; each token's estimate is how often tokens drafted from a
    context of its length and share bucket were accepted in this request so far."""
    group = EACH  # drafts alone (proposers/base.py)

    def __init__(self, store: Datastore, prompt_ids: Sequence[int], min_n: int = 1) -> None:
        self.store, self.min_n = store, min_n
        self.text = list(prompt_ids[-store.max_n:])
        self.agreement: dict[tuple[int, int], Acceptance] = {}
        self.pending: list[tuple[tuple[int, int], int]] = []  # (its key, token) of the last draft

    def propose(self, k: int) -> Draft:
        chain = self.store.chain(self.text, k, self.min_n)
        self.pending = [((n, share_bucket(share)), token) for token, n, share in chain]
        estimates = [self.agreement.setdefault(key, Acceptance()).rate for key, _ in self.pending]
        return Draft([token for _, token in self.pending], None, estimates) if chain else NO_DRAFT

    def commit(self, step: Committed) -> None:
        # a token is judged only where every token before it in the chain agreed (its parent accepted)
        for (key, token), committed in zip(self.pending, step.tokens):
            self.agreement.setdefault(key, Acceptance()).record(float(token == committed))
            if token != committed:
                break
        self.pending = []
        self.text = (self.text + list(step.tokens))[-self.store.max_n:]


@register("store", StoreOptions, loads="datastore", needs_file=True,
          about="the target's own answers: what it most often wrote after the text's last words (a datastore)")
def make_store(ctx: ProposerContext) -> StoreProposer:
    return StoreProposer(ctx.target.datastore(ctx.config.datastore), ctx.prompt_ids, ctx.options.store_min_n)
