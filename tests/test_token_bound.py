"""Tokenizer.min_tokens, the lower bound on a text's tokens from its length alone by which the
server refuses a prompt too long for the context before any tokenizer work (issue 35 item 2).

Oracle: the tokenizer's own count, on texts made to be short in tokens, for each kind of tokenizer
the bound claims (byte-level BPE, with or without a normalizer, with bytes its vocabulary lacks;
BPE with byte fallback); a negative control loosens the bound and must break it.
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from quickdraft.model.tokenizer import Tokenizer
from tiny_tokenizer import SPECIAL, build_tokenizer


def byte_fallback_tokenizer() -> RawTokenizer:
    """A SentencePiece-style BPE (spaces as "▁", byte fallback for what the vocabulary lacks)."""
    vocab = {s: i for i, s in enumerate(SPECIAL)}
    for piece in [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "é", "▁a", "ab", "▁ab", "▁ab▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b"), ("▁ab", "▁ab")]
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    return tok


def nfc_byte_level() -> RawTokenizer:
    tok = build_tokenizer()
    tok.normalizer = normalizers.NFC()
    return tok


def byte_level_missing_bytes() -> RawTokenizer:
    """Byte-level BPE whose vocabulary lacks some bytes' symbols (SmolLM2 lacks 0x04 and 0xf1, among
    others): the tokenizer drops those bytes."""
    spec = json.loads(build_tokenizer().to_str())
    for symbol in ("Ą", "ñ"):  # the symbols of 0x04 and 0xf1
        del spec["model"]["vocab"][symbol]
    return RawTokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("make", [build_tokenizer, byte_fallback_tokenizer, nfc_byte_level, byte_level_missing_bytes])
def test_the_length_bound_never_exceeds_the_tokens(make) -> None:
    """min_tokens <= len(encode) on text made to be short in tokens (the vocabulary's longest
    pieces, specials, characters NFC shortens: Hangul jamo, the Kelvin sign, combining marks;
    bytes a vocabulary drops); with the bound's bytes per token halved, or the dropped bytes
    counted, the same texts break it (the check can fail)."""
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=make()))
    assert tok.bytes_per_token is not None
    rng = random.Random(0)
    pieces = [*SPECIAL, " the", "ST", "STO", "中文", "😀", "é", "e\u0301", "\u1100\u1161\u11a8", "\u212a",
              " ab ab", " ", "a", "b", "<0x41>", "\u0000", "\U0001d400", "\x04", "\U00040000"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))) for _ in range(400)]
    texts += [p * 50 for p in pieces]
    for text in texts:
        assert tok.min_tokens(text) <= len(tok.encode(text)), text
    bound, dropped = tok._length_bound
    tok._length_bound = (max(1, bound // 2), dropped)  # a cached property: the instance's value wins
    assert any(tok.min_tokens(text) > len(tok.encode(text)) for text in texts)
    if dropped:
        tok._length_bound = (bound, b"")
        assert tok.min_tokens("\x04" * 100) > len(tok.encode("\x04" * 100)) == 0


def test_a_tokenizer_that_may_drop_text_gets_no_length_bound() -> None:
    """WordPiece drops whitespace and merges unknown words: no bound from length is sound there."""
    raw = RawTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))
    assert tok.bytes_per_token is None and tok.min_tokens(" " * 1000) == 0 == len(tok.encode(" " * 1000))
