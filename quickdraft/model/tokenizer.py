"""Tokenizers: encode/decode, chat templates, and a streaming detokenizer.

Wraps transformers' fast tokenizers (from tokenizer.json, or rebuilt from GGUF metadata).
Knows nothing of models.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Iterable, Mapping, Sequence

from jinja2 import TemplateError

from quickdraft.errors import NoChatTemplate, QuickdraftError

Message = dict[str, str]


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = {int(i) for i in extra_eos_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_text(text, "the prompt")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], keep: frozenset[int] = frozenset()) -> str:
        """The text of `ids`, special tokens dropped but those in `keep` (markers_of's)."""
        if not keep:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        return self.hf.decode([t for t in ids if t in keep or t not in self._special_ids], skip_special_tokens=False)

    def markers_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those of `texts` that are one special token, which decode drops unless kept
        (Mistral's [TOOL_CALLS]: a tool reply's text must show it)."""
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        return frozenset(i[0] for i in ids if len(i) == 1 and i[0] in self._special_ids)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """The tokens decode(skip_special_tokens=True) drops: the named special tokens and added
        tokens marked special."""
        added = getattr(self.hf, "added_tokens_decoder", {})
        return frozenset(self.hf.all_special_ids) | {i for i, token in added.items() if token.special}

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs bytes): a byte-level vocabulary's symbols mapped
        back to bytes (half a UTF-8 character stays half), else its text decoded alone."""
        piece = self.hf.convert_ids_to_tokens(int(token))
        symbols = _byte_values()
        if isinstance(piece, str) and piece and all(c in symbols for c in piece):
            return bytes(symbols[c] for c in piece)
        return self.hf.decode([int(token)], skip_special_tokens=False).encode("utf-8")

    def token_strings(self) -> list[str]:
        """Token id -> the string stored in the vocabulary (for checking two vocabularies agree)."""
        return self.hf.convert_ids_to_tokens(list(range(len(self.hf))))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt), add_special_tokens=False)

    def chat_text(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as the chat template writes it (apply_chat_template's text); tools: OpenAI's
        tools, for a template that shows them (tools.py decides)."""
        if not self.has_chat_template:
            raise NoChatTemplate("this model's tokenizer has no chat template; pass a plain prompt instead", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat messages need string 'role' and 'content', found {m!r}")
            _check_text(m["content"], f"the content of a {m['role']!r} message")
        try:
            return self.hf.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                               add_generation_prompt=add_generation_prompt, tokenize=False)
        except TemplateError as e:  # the template's own refusal (raise_exception), or a message it cannot take
            raise QuickdraftError(f"the chat template cannot write this conversation: {e}") from None

    def min_tokens(self, text: str, normalize: bool = True) -> int | None:
        """A lower bound on len(encode(text)) from the text's length, for no tokenizer work (0 where
        the tokenizer allows none): every byte of the normalized text that has a token is in one
        token, and no token stands for more than bytes_per_token of them. normalize=False: None
        where the bound needs the text normalized (a normalizer that may shorten it, e.g. NFC on
        non-ASCII text; ~60 ms a MiB), so the caller can do that work elsewhere."""
        if self.bytes_per_token is None:
            return 0
        normalizer = self.hf.backend_tokenizer.normalizer
        if normalizer is not None and not (self._keeps_ascii_length and text.isascii()):
            if not normalize:
                return None
            text = normalizer.normalize_str(text)
        data = text.encode("utf-8", "surrogatepass")
        if self._dropped_bytes:  # bytes the vocabulary has no token for: the tokenizer drops them
            data = data.translate(None, self._dropped_bytes)
        return -(-len(data) // self.bytes_per_token)

    @functools.cached_property
    def _keeps_ascii_length(self) -> bool:
        """Whether normalizing never shortens ASCII text: Unicode normal forms and lowercasing keep
        it as it is, prepending and replacing a string with one as long or longer ("▁" for " ")
        lengthen it (unless with bytes the tokenizer drops)."""
        normalizer = json.loads(self.hf.backend_tokenizer.to_str()).get("normalizer") or {}
        parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
        for part in parts:
            kind = part.get("type")
            if kind == "Replace":
                pattern = part.get("pattern", {})
                content = part["content"].encode()
                if ("String" not in pattern or len(content) < len(pattern["String"].encode())
                        or set(content) & set(self._dropped_bytes)):
                    return False
            elif kind not in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"):
                return False
        return True

    @property
    def bytes_per_token(self) -> int | None:
        """The most bytes of normalized text one token stands for, where every byte is in at most one
        token and the rest are dropped (None where no such bound holds)."""
        return self._length_bound[0]

    @property
    def _dropped_bytes(self) -> bytes:
        return self._length_bound[1]

    @functools.cached_property
    def _length_bound(self) -> tuple[int | None, bytes]:
        """(bytes_per_token, the byte values the tokenizer drops) for byte-level BPE (each byte a
        symbol, one character of the vocabulary's strings; a byte whose symbol the vocabulary lacks,
        such as SmolLM2's 0x04 or 0xf1, is dropped or fused into an unknown token) and for BPE with
        byte fallback and all 256 byte tokens (a vocabulary string is the text's, spaces as the
        3-byte "▁", and a byte's token "<0x41>" is longer than its byte). (None, b"") for the rest
        (WordPiece, Unigram, BPE over characters without byte fallback), which may drop or merge
        any text."""
        backend = json.loads(self.hf.backend_tokenizer.to_str())
        model = backend["model"]
        byte_level = "ByteLevel" in json.dumps(backend.get("pre_tokenizer"))
        if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
            return None, b""
        vocab = model["vocab"]
        if byte_level:
            dropped = bytes(b for b, symbol in enumerate(_byte_symbols()) if symbol not in vocab)
            length = len  # a symbol per byte
        elif all(f"<0x{b:02X}>" in vocab for b in range(256)):
            dropped, length = b"", (lambda piece: len(piece.encode("utf-8")))
        else:
            return None, b""
        added = [t["content"].encode("utf-8") for t in backend.get("added_tokens", [])]  # matched in the raw text
        return max(max(map(length, vocab)), *map(len, added), 1), dropped


@functools.cache
def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> the vocabulary's one-character symbol for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@functools.cache
def _byte_values() -> dict[str, int]:
    """_byte_symbols inverted: a byte-level vocabulary's symbol -> its byte."""
    return {symbol: b for b, symbol in enumerate(_byte_symbols())}


def unicode_error(text: str) -> str | None:
    """Why `text` is no valid Unicode (a lone surrogate such as "\\ud800", which JSON and Python
    strings can carry but no tokenizer encodes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"found the lone surrogate {text[e.start]!r} at character {e.start}; expected valid Unicode text"
    return None


def _check_text(text: str, what: str) -> None:
    if (error := unicode_error(text)) is not None:
        raise QuickdraftError(f"{what}: {error}")


class StreamDetokenizer:
    """Turns token ids into text deltas, holding back bytes of an unfinished UTF-8 character.

    Decodes a short window (from `prefix` on) rather than everything, and emits what the window's
    text gained; a trailing U+FFFD means a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer, self.keep = tokenizer, keep  # keep: special tokens whose text is kept
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0    # ids already turned into emitted text

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        done = self.tokenizer.decode(self.ids[self.prefix:self.read], self.keep)
        text = self.tokenizer.decode(self.ids[self.prefix:], self.keep)
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes to U+FFFD)."""
        done = self.tokenizer.decode(self.ids[self.prefix:self.read], self.keep)
        text = self.tokenizer.decode(self.ids[self.prefix:], self.keep)
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


class StopStringFilter:
    """Cuts streamed text at the first stop string, holding back any tail that may begin one.

    Incremental: for each stop string a Knuth-Morris-Pratt state (how many of its first characters
    end the text so far) carries over between feeds, so a feed costs O(len(delta) * len(stops))
    however long the stop strings and the text are."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        assert all(self.stops), "empty stop strings are refused by SamplingParams"
        self.fallback = [_kmp_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        text = self.pending + delta
        first = len(text)  # the earliest start of a stop string in text, if any
        for i, (stop, fallback) in enumerate(zip(self.stops, self.fallback)):
            state = self.state[i]
            for at in range(len(self.pending), len(text)):
                c = text[at]
                while state and stop[state] != c:
                    state = fallback[state - 1]
                if stop[state] == c:
                    state += 1
                if state == len(stop):
                    first = min(first, at + 1 - state)
                    break  # this stop's later occurrences start later
            self.state[i] = state
        if first < len(text):
            self.pending, self.state = "", [0] * len(self.stops)
            return text[:first], True
        hold = max(self.state, default=0)  # the longest tail that begins a stop string
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        self.state = [0] * len(self.stops)
        return text


def _kmp_failure(s: str) -> list[int]:
    """f[i]: the length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
