"""Tool calling (OpenAI's `tools`): how a request's tools and a conversation's earlier calls reach the
chat template, the grammar a reply's calls are written under, and a reply read back into calls,
whole or as it streams.

A call is {"name": ..., "arguments": {...}}, as json.dumps writes it, in one of two syntaxes:
- HERMES, where the template writes earlier calls as `<tool_call>\\n{...}\\n</tool_call>` (Qwen2.5's
  does): the template gets the tools and the history as they are;
- GENERIC elsewhere (SmolLM2's template knows no tools), as llama.cpp's generic format: the tools are
  listed in the system turn, a reply's calls are one JSON object {"tool_calls": [...]}, and earlier
  calls and tool results are written into the turns as JSON.
Either way the grammar (llguidance Lark, each function's arguments under its JSON schema) shapes the
calls, so `required` and a named function hold on every model, and `auto` lets the model write text.
Knows chat messages and grammar text; not the tokenizer, the engine or HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import AbstractSet as Set, Any, Callable, Literal, Mapping, Sequence

from quickdraft.grammar import JSON_OPTIONS

Choice = Literal["none", "auto", "required", "function"]
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters
# a schema's values that are data, not schemas: no references to move inside them
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


@dataclass(frozen=True)
class Function:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))  # its arguments' JSON schema
    description: str | None = None
    strict: bool = False  # keywords the grammar library does not implement: refused (True) or unchecked

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's shape, as chat templates take it."""
        described = {"description": self.description} if self.description else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class Tools:
    """A request's functions and what the reply may do with them: `none` write text only, `auto`
    text or calls, `required` one call or more, `function` call `name`; `parallel`: more than one
    call in a reply."""
    functions: tuple[Function, ...]
    choice: Choice = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        assert (self.choice == "function") == (self.name is not None), "a name with choice 'function' only"

    def callable(self) -> tuple[Function, ...]:
        """The functions the reply may call."""
        if self.choice == "none":
            return ()
        return tuple(f for f in self.functions if self.choice != "function" or f.name == self.name)


@dataclass(frozen=True)
class Syntax:
    """How a reply writes its calls: `first` before the first, `between` two, `last` after the last.
    native: the template shows the tools and earlier calls itself. trigger: under `auto`, where the
    calls begin; text may come before it (HERMES), or a reply is text or calls, its text never
    beginning as calls do (GENERIC, trigger None)."""
    native: bool
    first: str
    between: str
    last: str
    trigger: str | None
    markers: tuple[str, ...] = ()  # texts a vocabulary may hold as special tokens


GENERIC = Syntax(False, '{"tool_calls": [', ", ", "]}", None)
HERMES = Syntax(True, "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "<tool_call>",
                ("<tool_call>", "</tool_call>"))

# (messages, tools) -> the template's text
Render = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], str]
PROBE = Function("quickdraft_probe", {"type": "object", "properties": {"x": {"type": "string"}}})


def syntax_of(render: Render) -> Syntax:
    """HERMES where the template lists the tools it is given, writes an earlier call as Hermes does
    and shows the tool's result; else GENERIC."""
    call = {"name": PROBE.name, "arguments": {"x": "probe value"}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function",
                                                                      "function": call}]},
                {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"}]
    try:
        text = render(messages, [PROBE.as_tool()])
    except Exception:  # noqa: BLE001 (a template that cannot take these messages: jinja raises many types)
        return GENERIC
    written = text.find(HERMES.first + json.dumps(call) + HERMES.last)
    return HERMES if -1 < text.find(f'"{PROBE.name}"') < written and "probe result" in text else GENERIC


# -- the prompt -------------------------------------------------------------------------------------------

def conversation(messages: Sequence[Mapping[str, Any]], tools: Tools | None, syntax: Syntax
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the chat template takes them. Earlier calls' arguments are objects (templates
    write them with tojson; OpenAI sends JSON text). GENERIC: the tools and how to call them in the
    system turn (unless choice none), earlier calls and tool results as JSON text in their turns."""
    listed = tools.functions if tools is not None and tools.choice != "none" else ()
    if syntax.native:
        return [_with_object_arguments(m) for m in messages], [f.as_tool() for f in listed] or None
    calls = {c.get("id"): (c["function"]["name"], i if len(m["tool_calls"]) > 1 else None)
             for m in messages for i, c in enumerate(m.get("tool_calls") or ())}
    turns = [_generic_turn(m, calls) for m in messages]
    if listed:
        turns = _with_system(turns, instructions(tools))
    return turns, None


def instructions(tools: Tools) -> str:
    """GENERIC's system text: the functions, and the reply's format."""
    functions = [{"name": f.name, **({"description": f.description} if f.description else {}),
                  "parameters": f.parameters} for f in tools.functions]
    shape = json.dumps({"tool_calls": [{"name": "<a tool's name>", "arguments": {"<parameter>": "<value>"}}]})
    when = {"auto": " Otherwise, reply in plain text.", "required": " Call at least one tool.",
            "function": f" Call the tool {tools.name}."}[tools.choice]
    many = "" if tools.parallel else " Call one tool at a time."
    return (f"You can call these tools:\n{json.dumps(functions, indent=2)}\n\nTo call tools, reply with one JSON "
            f"object and nothing else: {shape}.{when}{many}")


def _arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as an object where they are JSON text of one (else as they are)."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_object_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return dict(message)
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _generic_turn(message: Mapping[str, Any], calls: Mapping[Any, tuple[str, int | None]]) -> dict[str, Any]:
    """A message as GENERIC writes it: calls as the reply's JSON after any text, a tool's result as a
    user turn (a template without tools knows no tool role), named by its call's function and, where
    its turn made several calls, the call's position there. Never by the call's id: clients and our
    server make ids at random, and a prompt that changes with them changes the answer and misses the
    prefix cache."""
    if message.get("tool_calls"):
        calls = json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": _arguments(c)}
                                           for c in message["tool_calls"]]})
        text = message.get("content") or ""
        return {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
    if message.get("role") == "tool":
        name, index = calls.get(message.get("tool_call_id"), (message.get("name"), None))
        response = {"name": name, "call": index, "content": message.get("content")}
        return {"role": "user", "content": json.dumps({"tool_response": {k: v for k, v in response.items()
                                                                         if v is not None}})}
    return dict(message)


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- the grammar ------------------------------------------------------------------------------------------

def grammar(tools: Tools, syntax: Syntax, special: Set[str] = frozenset()) -> str | None:
    """The reply's grammar, in llguidance's Lark; None where the reply is free text (choice none).
    Calls are Lark around one JSON schema per call (its arguments the function's schema, moved under
    $defs with its references); under `auto` text may come instead (GENERIC: text not beginning with
    `{`) or before the calls (HERMES: text up to the first trigger). special: the syntax's markers
    the vocabulary holds as special tokens (Qwen2.5's <tool_call>), written as those tokens: their
    text spelled out would be other tokens, which the model never writes."""
    functions = tools.callable()
    if not functions:
        return None
    special = frozenset(special) & frozenset(syntax.markers)
    more = f" ({_lark(syntax.between, special)} call)*" if tools.parallel else ""
    calls = f"{_lark(syntax.first, special)} call{more} {_lark(syntax.last, special)}"
    if tools.choice != "auto":
        lines = [f"start: {calls}"]
    elif syntax.trigger is None:
        lines = [f"start: TEXT | {calls}", f"TEXT: /[^{_regex_escape(syntax.first[0])}](.|\\n)*/"]
    elif syntax.trigger in special:  # text cannot hold a special token: it ends where the trigger comes
        lines = [f"start: TEXT | TEXT {calls}", "TEXT: /(.|\\n)*/"]
    else:  # text up to the first trigger, a lazy lexeme: the calls begin there
        rest = _lark(syntax.first[len(syntax.trigger):], special)
        lines = [f"start: TEXT | head {rest} call{more} {_lark(syntax.last, special)}", "TEXT: /(.|\\n)*/",
                 f"head[lazy]: TEXT {_lark(syntax.trigger, special)}"]
    return "\n".join(["%llguidance {}", *lines, f"call: %json {json.dumps(_call_schema(functions))}"]) + "\n"


def _lark(text: str, special: frozenset[str]) -> str:
    """`text` as Lark: quoted strings, the special markers in it as their tokens (`<tool_call>`)."""
    pieces = re.split("(" + "|".join(map(re.escape, sorted(special))) + ")", text) if special else [text]
    return " ".join(piece if piece in special else json.dumps(piece) for piece in pieces if piece)


def _regex_escape(char: str) -> str:
    return "\\" + char if char in "\\^]-[/" else char


def _call_schema(functions: Sequence[Function]) -> dict[str, Any]:
    """One call of any of `functions`: {"name": its name, "arguments": under its schema}, on one line
    as json.dumps writes it (the grammar's JSON_OPTIONS); lenient unless every function is strict
    (each one's own strictness is checked when its schema is compiled alone)."""
    defs, calls = {}, []
    for i, function in enumerate(functions):
        where = f"#/$defs/arguments_{i}"
        defs[f"arguments_{i}"] = _moved(function.parameters, where)
        calls.append({"type": "object", "properties": {"name": {"const": function.name},
                                                       "arguments": {"$ref": where}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    options = {**JSON_OPTIONS, "lenient": not all(f.strict for f in functions)}
    return {**schema, "$defs": defs, "x-guidance": options}


def _moved(schema: Any, where: str) -> Any:
    """`schema` placed at `where`: its references to its own root (#, #/...) made to point there."""
    if isinstance(schema, Mapping):
        return {key: (where + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                      else value if key in DATA_KEYWORDS else _moved(value, where))
                for key, value in schema.items()}
    if isinstance(schema, list):
        return [_moved(value, where) for value in schema]
    return schema
