"""What a request asks its reply's text to be: free, JSON under a response_format, or calls of its
tools (with the response_format where it answers without a call); checked, then compiled into the
grammar the engine follows. Knows the structured-output layer, not the tokenizer's threads or HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from quickdraft.errors import RequestError
from quickdraft.structured.grammar import Constraint, GrammarError, Vocabulary, constrain, grammar_text
from quickdraft.structured.harmony_grammar import harmony_constraint
from quickdraft.structured.tools import Syntax, Tools, ToolsError, compile_tools, request_tools

FORMAT_CODE = GrammarError.code


@dataclass(frozen=True)
class Shape:
    tools: Tools | None                         # None: the request offers none
    response_format: Mapping[str, Any] | None  # OpenAI's, as grammar_text takes it; None: text

    @property
    def free(self) -> bool:
        """No grammar: the model writes what it likes."""
        return self.tools is None and self.response_format is None


def shape_of(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel_tool_calls: Any,
             response_format: Mapping[str, Any] | None, chat: bool) -> Shape:
    """The request's tools (tools.request_tools: a ToolsError names the field) and its response
    format, {"type": "text"} as none; tools only in a chat (`chat`: the prompt is messages)."""
    chosen = request_tools(tools, tool_choice, parallel_tool_calls)
    if chosen is not None and not chat:
        raise ToolsError("tools: tools are offered in a chat; give messages, not a prompt", "tools")
    if response_format is not None and not isinstance(response_format, Mapping):
        raise RequestError(f"response_format: expected an object such as {{\"type\": \"json_object\"}}, found "
                           f"{response_format!r}", "response_format", FORMAT_CODE)
    formatted = response_format is not None and response_format.get("type") != "text"
    return Shape(chosen, dict(response_format) if formatted else None)


def constraint_of(shape: Shape, vocabulary: Vocabulary, syntax: Syntax) -> Constraint | None:
    """The reply's grammar (None: free text), compiled: a schema llguidance refuses is a
    RequestError naming its field. Takes time (the server runs it on its grammar threads). A harmony
    reply's calls and answer sit in its channels (harmony_grammar.py)."""
    if syntax.channels:
        return harmony_constraint(vocabulary, shape.tools, shape.response_format)
    if shape.tools is not None:
        return compile_tools(vocabulary, shape.tools, syntax, shape.response_format)
    if shape.response_format is None:
        return None
    try:
        return constrain(vocabulary, grammar_text(shape.response_format))
    except GrammarError as e:
        raise GrammarError(str(e), "response_format") from None
