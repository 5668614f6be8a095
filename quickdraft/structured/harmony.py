"""gpt-oss's harmony format read back (tools.HARMONY): a reply is messages, each a header (its channel,
and for a call its recipient) up to <|message|>, then a body up to <|end|>, <|call|> or <|return|>; the
next opens with <|start|>. After the prompt's `<|start|>assistant` the model writes, e.g.

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

The analysis channel is reasoning (kept out of the content, as OpenAI's API keeps it); final, and
commentary without a recipient (a preamble), are content; a message to functions.NAME is a call of
NAME with its arguments' JSON as its body, its recipient in the channel's header or in the role's
(as the template writes earlier calls). Read as it streams (`Reader`) or whole (`read`), with the same
result however the text is cut; no marker's text reaches the content or the reasoning. Knows the
format, not the tokenizer or HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from quickdraft.structured.tool_reply import Call, CallPiece, calls_of, merged
from quickdraft.structured.tools import HARMONY

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = HARMONY.markers
ENDS = frozenset({END, RETURN, CALL})
MARKERS = frozenset(HARMONY.markers)
PIECES = re.compile("(" + "|".join(map(re.escape, HARMONY.markers)) + ")")
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
FUNCTIONS = "functions."
# what ends a turn, as gpt-oss's generation_config.json lists it: its answer (<|return|>), its call
# (<|call|>), the end of text; never <|end|>, which ends one message (the answer follows the reasoning's)
TURN_ENDS = (RETURN, CALL, "<|endoftext|>")
# between two messages read into one field (two analysis messages' reasoning, a preamble and an answer)
SEPARATOR = "\n"

Kind = Literal["reasoning", "content", "call"]


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str
    calls: list[Call]  # every call begun, the last one perhaps unfinished
    complete: bool     # a call was made and every call's arguments are a whole JSON object

    @property
    def whole(self) -> list[Call]:
        """The calls whose arguments are whole: one cut short (the token budget) is never handed on."""
        return [call for call in self.calls if is_object(call.arguments)]


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def read(text: str, calls: bool = True) -> Reply:
    """A whole reply; calls: messages to functions.NAME are calls (the request offers tools), else
    reasoning, as messages to any other recipient are (a built-in tool's, which no request offers)."""
    reader = Reader(calls)
    content, reasoning, pieces = reader.feed(text, end=True)
    return Reply(content, reasoning, calls_of(pieces), reader.complete)


class Reader:
    """feed() the reply's text as it comes; each feed returns the (content, reasoning, call pieces) it
    adds. A header is held until its <|message|> says what the body is; a body's tail that may begin a
    marker, until it does or does not."""

    def __init__(self, calls: bool = True) -> None:
        self.offered = calls           # messages to functions.NAME are calls (else reasoning)
        self.pending = ""              # text not yet read: a tail that may begin a marker
        self.header: str | None = ""   # the header so far, markers and all; None: in a body
        self.role = False              # the header follows <|start|>: it opens with the role's name
        self.kind: Kind = "content"    # the open body's
        self.fresh = True              # the open body has written nothing yet
        self.said = {"content": False, "reasoning": False}
        self.arguments: list[str] = []  # each call's so far

    @property
    def complete(self) -> bool:
        return bool(self.arguments) and all(map(is_object, self.arguments))

    def feed(self, text: str, end: bool = False) -> tuple[str, str, list[CallPiece]]:
        self.pending += text
        hold = 0 if end else _marker_head(self.pending)
        text, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        out: dict[str, list[str]] = {"content": [], "reasoning": []}
        pieces: list[CallPiece] = []
        for part in PIECES.split(text):
            if part in MARKERS:
                self._marker(part, out, pieces)
            elif self.header is not None:
                self.header += part
            elif part:
                self._say(part, out, pieces)
        if end and self.header is not None:
            self._loose(out)
        return "".join(out["content"]), "".join(out["reasoning"]), merged(pieces)

    def _marker(self, marker: str, out: dict[str, list[str]], pieces: list[CallPiece]) -> None:
        if self.header is None:  # in a body: an end or a new message closes it; other markers are stray
            if marker in ENDS or marker == START:
                self.header, self.role = "", marker == START
            return
        if marker == MESSAGE:
            self._open(pieces)
        elif marker in ENDS or marker == START:  # a header that never opened a body
            self._loose(out)
            self.header, self.role = "", marker == START
        else:
            self.header += marker

    def _open(self, pieces: list[CallPiece]) -> None:
        """The header is whole: what its body is."""
        header, self.header, self.fresh = self.header or "", None, True
        found = RECIPIENT.search(header)
        # gpt-oss-20b sometimes addresses its own message to=assistant: no recipient
        recipient = found[1] if found and found[1] != "assistant" else None
        channel = CHANNEL_NAME.search(header)
        if recipient is not None and recipient.startswith(FUNCTIONS) and self.offered:
            self.kind = "call"
            pieces.append(CallPiece(len(self.arguments), recipient[len(FUNCTIONS):], ""))
            self.arguments.append("")
        elif recipient is not None or (channel is not None and channel[1] == "analysis"):
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _say(self, text: str, out: dict[str, list[str]], pieces: list[CallPiece]) -> None:
        if self.kind == "call":
            pieces.append(CallPiece(len(self.arguments) - 1, None, text))
            self.arguments[-1] += text
            return
        if self.fresh and self.said[self.kind]:
            text = SEPARATOR + text
        out[self.kind].append(text)
        self.said[self.kind], self.fresh = True, False

    def _loose(self, out: dict[str, list[str]]) -> None:
        """A header that never opened a body: text the model wrote outside the format is content (a
        model that ignores the format still answers); one with markers in it, or a role's, is a
        broken header, dropped (its markers are no text)."""
        header, self.header = self.header or "", ""
        if header and not self.role and not any(marker in header for marker in MARKERS):
            self.kind, self.fresh = "content", True
            self._say(header, out, [])


class ReasoningTokens:
    """Counts a reply's reasoning tokens, fed one token's text at a time: those of bodies the Reader
    reads as reasoning (usage's reasoning_tokens), markers and headers not."""

    def __init__(self, calls: bool = True) -> None:
        self.reader, self.count = Reader(calls), 0

    def feed(self, text: str) -> None:
        self.reader.feed(text)
        if self.reader.header is None and self.reader.kind == "reasoning" and text not in MARKERS:
            self.count += 1


def _marker_head(text: str) -> int:
    """The length of the longest tail of `text` that begins a marker and is not yet one (held until it
    is one or is not)."""
    at = text.find("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    while at >= 0:
        tail = text[at:]
        if any(len(tail) < len(marker) and marker.startswith(tail) for marker in MARKERS):
            return len(tail)
        at = text.find("<", at + 1)
    return 0
