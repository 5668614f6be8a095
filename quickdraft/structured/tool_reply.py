"""A reply under tools (tools.py) read back into its text and its calls, as it streams: each call's
name once whole, then its arguments' JSON text piece by piece, as OpenAI's stream deltas carry them.

The grammar wrote the reply, so each piece stands where the syntax says; a reply cut short (the
token budget, a stop string) leaves its last call unfinished, and text that is not where the
syntax says is passed on as text, never dropped. One reply the grammar leaves free is a call too:
under `auto`, where text may come before the calls (HERMES, MISTRAL), a reply that is nothing but a
bare JSON call of a listed function, as small models write them (llama.cpp's and vLLM's parsers
take them too). Knows tools.py's syntaxes, nothing else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from quickdraft.structured.tools import ENDING, Syntax, Tools

HEAD = '{"name": "'
BARE_KEYS = ({"name", "arguments"}, {"name", "parameters"})  # a bare call's keys (llama.cpp takes both)


@dataclass
class CallPiece:
    index: int            # the call's place in the reply
    name: str | None      # on its first piece only
    arguments: str        # the next piece of its arguments' JSON text


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as the model wrote it


class Reader:
    """feed() the reply's text as it comes; each call returns the new text and call pieces (text that
    may still turn out to begin a call is held back until it does or does not)."""

    def __init__(self, tools: Tools, syntax: Syntax) -> None:
        self.syntax = syntax
        self.name_end = f'", "{syntax.key}": '
        self.functions = frozenset(f.name for f in tools.callable())
        self.pending = ""   # text not yet read
        self.state = "text" if tools.choice == "auto" else "first"
        self.said = False   # text passed on
        self.calls = 0      # calls begun
        self.depth, self.in_string, self.escaped = 0, False, False  # the arguments' JSON, read so far

    @property
    def complete(self) -> bool:
        """Whether every call begun is finished (and one was)."""
        return self.state == "done"

    def feed(self, text: str, end: bool = False) -> tuple[str, list[CallPiece]]:
        """(text, call pieces) read from `text`; end: the reply is over (nothing is held back)."""
        self.pending += text
        content: list[str] = []
        pieces: list[CallPiece] = []
        while self.pending and self._step(content, pieces, end):
            pass
        if end and self.pending:
            content.append(self.pending)  # an unfinished call's head or tail: text, not lost
            self.pending = ""
        self.said = self.said or any(content)
        return "".join(content), merged(pieces)

    def _step(self, content: list[str], pieces: list[CallPiece], end: bool) -> bool:
        """Read what the pending text allows in the current state; False: wait for more."""
        syntax, pending = self.syntax, self.pending
        if self.state == "text":
            return self._text(content, pieces, end)
        if self.state == "done" and ENDING.startswith(pending):  # the grammar's ending: not text
            if end:
                self.pending = ""
            return False
        if self.state in ("content", "done"):
            content.append(pending)
            self.pending = ""
            return False
        if self.state == "first":
            return self._literal(syntax.first, "name", end)
        if self.state == "name":
            if not pending.startswith(HEAD[:len(pending)]):
                self.state = "content"
                return True
            stop = pending.find(self.name_end, len(HEAD))
            if stop < 0:
                return False
            pieces.append(CallPiece(self.calls, pending[len(HEAD):stop], ""))
            self.calls += 1
            self.pending, self.state = pending[stop + len(self.name_end):], "arguments"
            self.depth, self.in_string, self.escaped = 0, False, False
            return True
        if self.state == "arguments":
            done = self._scan()
            pieces.append(CallPiece(self.calls - 1, None, self.pending[:done]))
            self.pending = self.pending[done:]
            if self.state == "arguments":
                return False
            return True
        # "after" a call's arguments: its closing brace, then the next call (where the syntax has more) or the end
        after, last = None if syntax.between is None else "}" + syntax.between, "}" + syntax.last
        if after is not None and pending.startswith(after):
            self.pending, self.state = pending[len(after):], "name"
            return True
        more = after is not None and after.startswith(pending)  # the next call's beginning, so far
        if pending.startswith(last) and (end or not more):
            self.pending, self.state = pending[len(last):], "done"
            return True
        if not end and (more or last.startswith(pending)):
            return False
        self.state = "content"
        return True

    def _text(self, content: list[str], pieces: list[CallPiece], end: bool) -> bool:
        """Under `auto`: text, until the calls begin."""
        syntax, pending = self.syntax, self.pending
        if syntax.trigger is None:  # text or calls, told apart by the first character
            self.state = "first" if pending[0] == syntax.opening else "content"
            return True
        if not self.said and (bare := self._bare(pieces, end)) is not None:
            return bare
        at = pending.find(syntax.first)
        if at >= 0:
            content.append(pending[:at])
            self.pending, self.state = pending[at:], "first"
            return True
        held = 0 if end else next((n for n in range(min(len(pending), len(syntax.first) - 1), 0, -1)
                                   if syntax.first.startswith(pending[-n:])), 0)
        content.append(pending[:len(pending) - held])
        self.pending = pending[len(pending) - held:]
        return False

    def _bare(self, pieces: list[CallPiece], end: bool) -> bool | None:
        """A reply that may be a bare call (it begins with "{") held back until it is one (read at its
        end) or is not (None: text)."""
        head = self.pending.lstrip()
        if not head or head[0] != "{":
            return None if head or end else False
        try:
            value, stop = json.JSONDecoder().raw_decode(head)
        except ValueError:  # not yet whole, or not JSON
            return None if end else False
        arguments = _bare_arguments(value, self.functions)
        if arguments is None or head[stop:].strip():
            return None
        if not end:
            return False
        pieces.append(CallPiece(0, value["name"], json.dumps(arguments)))
        self.calls, self.pending, self.state = 1, "", "done"
        return False

    def _literal(self, literal: str, then: str, end: bool) -> bool:
        if self.pending.startswith(literal):
            self.pending, self.state = self.pending[len(literal):], then
            return True
        if literal.startswith(self.pending) and not end:
            return False
        self.state = "content"
        return True

    def _scan(self) -> int:
        """How much of the pending text belongs to the arguments' JSON value; state "after" once it
        is whole (a container or string closed at depth 0, or a bare value ended by what follows)."""
        for i, char in enumerate(self.pending):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.state = "after"
                        return i + 1
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]" and self.depth > 0:
                self.depth -= 1
                if self.depth == 0:
                    self.state = "after"
                    return i + 1
            elif self.depth == 0 and char in ",}]":
                self.state = "after"
                return i
        return len(self.pending)


def _bare_arguments(value: Any, functions: frozenset[str]) -> Mapping[str, Any] | None:
    """The arguments of `value` where it is a call of one of `functions` ({"name": ..., "arguments"
    or "parameters": {...}}), else None."""
    if not isinstance(value, dict) or set(value) not in BARE_KEYS or not isinstance(value["name"], str) or \
            value["name"] not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    return arguments if isinstance(arguments, dict) else None


@dataclass(frozen=True)
class Reply:
    content: str       # the text outside the calls
    calls: list[Call]  # the last one unfinished unless complete
    complete: bool     # every call begun is finished (and one was)

    @property
    def whole(self) -> list[Call]:
        """The finished calls: one cut short (the token budget) is never handed on as a call."""
        return self.calls if self.complete else self.calls[:-1]


def read(tools: Tools, syntax: Syntax, text: str) -> Reply:
    """A whole reply's text and calls."""
    reader = Reader(tools, syntax)
    content, pieces = reader.feed(text, end=True)
    return Reply(content, calls_of(pieces), reader.complete)


def merged(pieces: list[CallPiece]) -> list[CallPiece]:
    """A feed's pieces, one per call (a call's consecutive pieces joined)."""
    joined: list[CallPiece] = []
    for piece in pieces:
        if joined and joined[-1].index == piece.index:
            joined[-1].arguments += piece.arguments
        else:
            joined.append(piece)
    return joined


def calls_of(pieces: list[CallPiece]) -> list[Call]:
    """The calls a whole reply's pieces spell (Reader.feed(text, end=True))."""
    names: list[str] = []
    arguments: list[str] = []
    for piece in pieces:
        if piece.name is not None:
            names.append(piece.name)
            arguments.append("")
        arguments[piece.index] += piece.arguments
    return [Call(n, a) for n, a in zip(names, arguments)]
