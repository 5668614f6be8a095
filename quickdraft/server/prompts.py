"""A request's text on its way to token ids: the tokenizer's work off the event loop, bounded.

A prompt that cannot fit the context is refused from its length alone (Tokenizer.min_tokens)
before any tokenizer work; the rest is rendered and tokenized on threads of their own, at most
TOKENIZE_THREADS at once for long texts and as many for short ones, so that long ones (a 1 MiB
prompt takes ~1 s of a core and ~100 MB) wait for each other and never hold up a short one; and
after a long text the allocator gives the freed memory back to the system. A prompt the length
bound lets through is tokenized in growing prefixes (requests/prompt.py `bounded`), stopping once
one is past the context, so a request's tokenizer work is bounded by the context, not by the body
(330 KB of text passes SmolLM2's bound, 81 bytes a token, at a 4,096 context). Also how the model's
chat template takes tools (`syntax`), which every front rendering a chat needs; and an echoed
prompt's tokens back to their text (`pieces`).
Knows the tokenizer, not the engine.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence, TypeVar

from quickdraft.model.tokenizer import Message, StreamDetokenizer, Tokenizer
from quickdraft.requests.prompt import bounded, text_of
from quickdraft.structured.tools import Tools, template_syntax

TOKENIZE_THREADS = 2     # tokenizations at once, of long and of short texts each; more wait their turn
LONG_CHARS = 1 << 14     # a long text (~16 ms to tokenize and up)
TRIM_AFTER_CHARS = 1 << 16  # after a text this long, free heap pages go back to the system
TRIM_DELAY_S = 0.5       # ... this long after it, once for all the texts in between (malloc_trim walks the heap)

T = TypeVar("T")


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None elsewhere (musl, macOS): freed memory stays with the process."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    return (lambda: trim(0)) if trim is not None else None


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    text = StreamDetokenizer(tokenizer)
    pieces = [text.push([token]) for token in ids]
    pieces[-1] += text.flush()  # what a cut character held back: the last token's
    return pieces


class Prompts:
    def __init__(self, tokenizer: Tokenizer, threads: int = TOKENIZE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.pools = {long: ThreadPoolExecutor(threads, thread_name_prefix=f"quickdraft-tokenize-{name}")
                      for long, name in ((False, "short"), (True, "long"))}
        _ = tokenizer.bytes_per_token  # the length bound (requests/prompt.py) computed now, not on a request
        # how this model's template takes tools (tools.py), found once by rendering a probe
        self.syntax = template_syntax(tokenizer)
        self._trim, self._timer, self._lock = _malloc_trim(), None, threading.Lock()

    async def min_tokens(self, text: str) -> int:
        """A lower bound on the text's tokens: on the event loop when it is a length (O(n) at memcpy
        speed), on the pool when the text must be normalized first."""
        bound = self.tokenizer.min_tokens(text, normalize=False)
        return bound if bound is not None else await self._run(len(text), self.tokenizer.min_tokens, text)

    async def chat_text(self, messages: Sequence[Message], tools: Tools | None, effort: str | None = None) -> str:
        """A chat's prompt text (prompt.text_of; rendering is fast next to tokenizing: a short task at
        any size); effort: a harmony template's reasoning effort."""
        return await self._run(0, text_of, self.tokenizer, self.syntax, messages, tools, effort)

    async def encode(self, text: str, add_special_tokens: bool = True, context: int | None = None) -> list[int]:
        """The text's token ids; with `context`, a text of more tokens than it holds may be refused
        (ContextTooLong) from a prefix, tokenized no further (`bounded`)."""
        if context is None:
            return await self._run(len(text), self.tokenizer.encode, text, add_special_tokens)
        return await self._run(len(text), bounded, self.tokenizer, text, add_special_tokens, context)

    async def pieces(self, ids: list[int]) -> list[str]:
        """Each token's text as a stream releases it (they join to the text of `ids`): an echoed prompt's."""
        return await self._run(len(ids), _pieces, self.tokenizer, ids)

    async def _run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        pool = self.pools[size >= LONG_CHARS]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def done_with(self, text: str) -> None:
        """A request is done with `text`: if it was long, the heap's free pages go back to the system
        TRIM_DELAY_S later (by then its body, text and tokens are freed; glibc keeps freed pieces)."""
        if self._trim is None or len(text) < TRIM_AFTER_CHARS:
            return
        with self._lock:
            if self._timer is not None:
                return  # the trim on its way covers this text too
            self._timer = threading.Timer(TRIM_DELAY_S, self._give_back)
            self._timer.daemon = True
            self._timer.start()

    def _give_back(self) -> None:
        with self._lock:
            self._timer = None
        self._trim()
