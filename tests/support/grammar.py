"""Structured output's test pieces: the tiny tokenizer's vocabulary, JSON schemas and their
constraints, the proposers and the engine run under a grammar, the 16-letter vocabulary (test_grammar's)."""
from __future__ import annotations

import functools
import json
from typing import Callable, Sequence

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from quickdraft.engine.batch import Engine, EngineConfig, Request
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.proposers.base import Proposer
from quickdraft.proposers.draft_model import DraftModelProposer
from quickdraft.proposers.drafter import Drafter
from quickdraft.proposers.ngram import NgramProposer
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import Constraint, Vocabulary, constrain, grammar_text
from support.models import V16, tiny
from tiny_tokenizer import EOS, EOS_ID, VOCAB_SIZE, build_tokenizer

MODEL = "llama-gqa-untied"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 3,
                                                                          "items": {"enum": ["a", "bb", "ccc"]}}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": -9, "maximum": 99}},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "status": {"enum": ["open", "closed"]},
                                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]}},
     "required": ["id", "status", "note"], "additionalProperties": False},
]


@functools.lru_cache(maxsize=None)
def tokenizer() -> Tokenizer:
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token=EOS))


@functools.lru_cache(maxsize=None)
def vocabulary() -> Vocabulary:
    return Vocabulary(tokenizer(), VOCAB_SIZE)


def schema_constraint(schema: dict) -> Constraint:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    return constrain(vocabulary(), grammar_text(fmt))


def target():
    return tiny(MODEL, init=0.1, vocab_size=VOCAB_SIZE)


@functools.lru_cache(maxsize=None)
def drafter(seed: int) -> Drafter:
    return Drafter(target() if seed == 0 else tiny(MODEL, seed=seed, vocab_size=VOCAB_SIZE))


def prompt_for(schema: dict) -> list[int]:
    """Text with JSON in it: prompt lookup finds keys and punctuation to draft."""
    example = {"name": "Bob", "age": 7, "ok": True, "tags": ["a"], "id": "AB-123", "status": "open", "note": None}
    return tokenizer().encode("Answer in JSON like " + json.dumps(example, separators=(",", ":")) + " please: ",
                              add_special_tokens=False)


PROPOSERS: dict[str, tuple[Callable[[list[int], SamplingParams], Proposer | None], int]] = {
    "plain": (lambda prompt, params: None, 0),
    "ngram": (lambda prompt, params: NgramProposer(prompt, 4, 1), 6),
    "ngram-tree": (lambda prompt, params: NgramProposer(prompt, 4, 1, branches=3), 8),
    "draft-same": (lambda prompt, params: DraftModelProposer(drafter(0), prompt, params, len(prompt) + 200), 4),
    "draft-random": (lambda prompt, params: DraftModelProposer(drafter(1), prompt, params, len(prompt) + 200), 3),
    "draft-tree": (lambda prompt, params: DraftModelProposer(drafter(0), prompt, params, len(prompt) + 400, 2), 6),
}


def run(jobs: Sequence[tuple[list[int], SamplingParams, str, Constraint | None]], max_batch: int
        ) -> tuple[list[list[int]], list[str]]:
    """Every job through one engine of max_batch rows: tokens and finish reason per job."""
    engine = Engine(target(), EngineConfig(max_batch=max_batch))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    finish: dict[str, str] = {}
    for i, (prompt, params, method, constraint) in enumerate(jobs):
        make, k = PROPOSERS[method]
        engine.add(Request(prompt, params, frozenset({EOS_ID}), make(prompt, params), k, constraint=constraint,
                           id=str(i)))
    for _ in range(2000):
        if not engine.has_work():
            break
        for rid, event in engine.step():
            assert event.error is None, event.error
            tokens[rid] += event.token_ids
            if event.finish_reason:
                finish[rid] = event.finish_reason
        for i, row in enumerate(engine.rows):  # finished ones too, until freed: the prefix cache takes their K/V
            # every emitted token but the newest has K/V, and the newest too where a stop token after it
            # (committed, not emitted) ended the request
            n = len(jobs[int(row.request.id)][0]) + len(tokens[row.request.id])
            held = n - (len(row.tokens) == n)
            assert engine.cache.lengths[i] == row.length == held, (row.request.id, finish.get(row.request.id))
    return [tokens[str(i)] for i in range(len(jobs))], [finish[str(i)] for i in range(len(jobs))]


def text(ids: list[int]) -> str:
    return tokenizer().decode(ids)


LETTERS = "abcdefghijklmnop"  # a 16-token vocabulary, one letter each (tiny16's)


@functools.lru_cache(maxsize=None)
def letters() -> Vocabulary:
    bpe = RawTokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return Vocabulary(Tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="p")), V16)
