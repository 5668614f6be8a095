"""Tool calling (OpenAI's `tools`): a request's tool fields checked into `Tools`, how its tools and a
conversation's earlier calls reach the chat template, the grammar a reply's calls are written under
(compiled for a vocabulary), shared by the server and the Python API.

A call is {"name": ..., "arguments": {...}}, as json.dumps writes it, in the syntax the model's template
writes earlier calls in (a row of `Syntax` each, found by rendering a probe: `syntax_of`):
- HERMES `<tool_call>\\n{...}\\n</tool_call>` (Qwen2.5), MISTRAL `[TOOL_CALLS] [{...}, ...]` (Mistral
  v0.3), LLAMA3 a bare `{"name": ..., "parameters": {...}}`, one per reply (Llama 3.1-3.3): the
  template gets the tools and the history, its call ids made positional;
- GENERIC elsewhere (SmolLM2's template knows no tools), as llama.cpp's generic format: the tools are
  listed in the system turn, a reply's calls are one JSON object {"tool_calls": [...]}, and earlier
  calls and tool results are written into the turns as JSON.
Either way the grammar (llguidance Lark, each function's arguments under its JSON schema) shapes the
calls, so `required` and a named function hold on every model, and `auto` lets the model write text.
Knows chat messages and grammars; not the tokenizer, the engine or HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from quickdraft.errors import RequestError
from quickdraft.structured.grammar import (
    JSON_OPTIONS,
    Constraint,
    GrammarError,
    Vocabulary,
    constrain,
    grammar_text,
    lark_grammar,
    response_schema,
)

Choice = Literal["none", "auto", "required", "function"]
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters
# a schema's values that are data, not schemas: no references to move inside them
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


class ToolsError(RequestError, ValueError):
    """A request's tools, or tool_choice, that cannot be served; `param` names the field (OpenAI's)."""
    code = "invalid_tools"  # a request the published schema allows but its tools cannot serve


@dataclass(frozen=True)
class Function:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))  # its arguments' JSON schema
    description: str | None = None
    strict: bool = True  # keywords the grammar library does not implement: refused (true or unset) or unchecked

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
    """How a reply writes its calls: `first` before the first, `between` two (None: one call a reply,
    all the template can write), `last` after the last; each call {"name": ..., <key>: {...}}.
    native: the template shows the tools and earlier calls itself. trigger: under `auto`, where the
    calls begin; text may come before it (HERMES, MISTRAL), or a reply is text or calls, its text never
    beginning as calls do (GENERIC, LLAMA3: trigger None)."""
    native: bool
    first: str
    between: str | None
    last: str
    trigger: str | None
    markers: tuple[str, ...] = ()  # texts a vocabulary may hold as special tokens
    key: str = "arguments"
    holder: str | None = None  # the key of the one JSON object whose list holds the calls (GENERIC)
    channels: bool = False     # harmony: a reply is messages on channels, calls among them (harmony.py)

    @property
    def opening(self) -> str:
        """The first character of a reply's calls."""
        return (self.first or "{")[0]


GENERIC = Syntax(False, '{"tool_calls": [', ", ", "]}", None, holder="tool_calls")
HERMES = Syntax(True, "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "<tool_call>",
                ("<tool_call>", "</tool_call>"))
# Mistral v0.3's template: the calls as one JSON list after [TOOL_CALLS] (a special token there); the
# template adds each call's id to the history, the model writes none
MISTRAL = Syntax(True, "[TOOL_CALLS] [", ", ", "]", "[TOOL_CALLS]", ("[TOOL_CALLS]",))
# Llama 3.1-3.3's templates: a custom tool's call is the whole reply, bare JSON with its arguments under
# "parameters", and they refuse a turn of several. (<|python_tag|> begins calls of Llama's built-in
# tools, brave_search, wolfram_alpha and code, which no request here can define.)
LLAMA3 = Syntax(True, "", None, "", None, key="parameters")
NATIVE = (HERMES, MISTRAL, LLAMA3)  # probed in this order
# gpt-oss's harmony: its special tokens, as harmony.py names them, kept in a reply's text (the reply's
# structure); the template writes tools and earlier calls itself, in a format no call probe matches
HARMONY = Syntax(True, "", None, "", None, ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                            "<|return|>", "<|call|>"), channels=True)
# What a reply may write after its last call before it ends: the line break its template puts between
# two calls. Qwen2.5 writes "\n" after </tool_call> and then wants its end token (logprob -0.0); a
# grammar that allowed only another call there forced <tool_call> (logprob -27), and calls the model
# never meant ran on until max_tokens.
ENDING = "\n"

# (messages, tools) -> the template's text
Render = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], str]
PROBE = Function("quickdraft_probe", {"type": "object", "properties": {"x": {"type": "string"}}})


def template_syntax(tokenizer: Any) -> Syntax:
    """How a tokenizer's chat template takes tools: HARMONY where every harmony marker is one special
    token and the template writes channels, else syntax_of's probe; GENERIC without a template."""
    if not tokenizer.has_chat_template:
        return GENERIC
    if len(tokenizer.markers_of(HARMONY.markers)) == len(HARMONY.markers) and \
            "<|channel|>" in str(tokenizer.hf.chat_template):
        return HARMONY
    return syntax_of(lambda messages, tools: tokenizer.chat_text(messages, tools=tools))


def syntax_of(render: Render) -> Syntax:
    """The native syntax whose call the template writes for an earlier call, where it also lists the
    tools it is given (before that call) and shows the tool's result; else GENERIC."""
    arguments = {"x": "probe value"}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": positional_id(0), "type": "function",
                    "function": {"name": PROBE.name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": positional_id(0), "content": "probe result"}]
    try:
        text = render(messages, [PROBE.as_tool()])
    except Exception:  # noqa: BLE001 (a template that cannot take these messages: jinja raises many types)
        return GENERIC
    listed = text.find(f'"{PROBE.name}"')
    for syntax in NATIVE:  # up to the call's arguments: MISTRAL's template adds the call's id after them
        written = text.find(syntax.first + json.dumps({"name": PROBE.name, syntax.key: arguments})[:-1])
        if -1 < listed < written and "probe result" in text:
            return syntax
    return GENERIC


def positional_id(n: int) -> str:
    """The id the n-th call of a conversation has in a native template's prompt: the same whatever id
    the client gave it (ids are random: a prompt that changed with them would change the answer and
    miss the prefix cache), nine letters and digits as Mistral's template demands."""
    return f"call{n:05d}"


# -- the request ------------------------------------------------------------------------------------------

def kept_markers(tokenizer: Any, syntax: Syntax, tools: Tools | None) -> frozenset[int]:
    """The special tokens a reply's text keeps: its tool syntax's markers where it may call (the
    reply is read for calls in that text: tool_reply.read); harmony's always, a reply's structure
    (a completion's raw text shows it too, as llama.cpp's does)."""
    keeps = syntax.channels or tools is not None and bool(tools.callable())
    return tokenizer.markers_of(syntax.markers) if keeps else frozenset()


def request_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None,
                  parallel_tool_calls: bool | None = None) -> Tools | None:
    """OpenAI's tools, tool_choice and parallel_tool_calls (as JSON decodes them) checked into Tools;
    None without tools (tool_choice then unset, none or auto). A ToolsError names the field at fault."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolsError("tool_choice: there are no tools to call; give tools, or leave tool_choice unset",
                             "tool_choice")
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ToolsError(f"tools: expected a list of tools, found {type(tools).__name__}", "tools")
    functions = tuple(_function(tool, f"tools.{i}") for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    if (twice := next((name for i, name in enumerate(names) if name in names[:i]), None)) is not None:
        raise ToolsError(f"tools: two tools are named {twice!r}; expected each name once", "tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolsError(f"parallel_tool_calls: expected true or false, found {parallel_tool_calls!r}",
                         "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "none", "auto", "required"):
        return Tools(functions, tool_choice or "auto", None, parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) and \
        tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), Mapping) else None
    if not isinstance(name, str):
        raise ToolsError(f"tool_choice: expected none, auto, required or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, found {tool_choice!r}", "tool_choice")
    if name not in names:
        raise ToolsError(f"tool_choice: names the function {name!r}, which is not among the tools "
                         f"({', '.join(names)})", "tool_choice")
    return Tools(functions, "function", name, parallel)


def _function(tool: Any, where: str) -> Function:
    """One of OpenAI's tools ({"type": "function", "function": {"name", "description", "parameters",
    "strict"}}) as a Function; a ToolsError names the field at fault."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise ToolsError(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}, found {tool!r}",
                         f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ToolsError(f"{where}.function: expected an object with a name, found {function!r}", f"{where}.function")
    name, description = function.get("name"), function.get("description")
    parameters, strict = function.get("parameters"), function.get("strict")
    checks = ((isinstance(name, str) and NAME.fullmatch(name) is not None, "name", "a name of 1-64 letters, digits, _ "
                                                                                   "or -", name),
              (description is None or isinstance(description, str), "description", "text", description),
              (parameters is None or isinstance(parameters, Mapping), "parameters", "a JSON schema (an object)",
               parameters),
              (strict is None or isinstance(strict, bool), "strict", "true or false", strict))
    for ok, key, expected, found in checks:
        if not ok:
            raise ToolsError(f"{where}.function.{key}: expected {expected}, found {found!r}", f"{where}.function.{key}")
    return Function(name, parameters if parameters is not None else NO_ARGUMENTS, description, strict is not False)


# -- the reply's grammar -------------------------------------------------------------------------------

def compile_tools(vocabulary: Vocabulary, tools: Tools, syntax: Syntax,
                  response_format: Mapping[str, Any] | None = None) -> Constraint | None:
    """The reply's constraint (None: free text): each function's schema, and the response_format's,
    compiled alone first, so that one llguidance refuses is a ToolsError naming it. Compiling takes
    time (the server runs it on its grammar threads). The syntax's special markers are named by token
    id (the model's trained token; the reply's text keeps them: Tokenizer.markers_of). response_format
    (OpenAI's, not text): where the reply does not call, its text is JSON under that schema."""
    answer = checked(vocabulary, tools, response_format)
    lark = grammar(tools, syntax, special_ids(vocabulary, syntax.markers), answer)
    if lark is None:
        return None if response_format is None else constrain(vocabulary, grammar_text(response_format))
    return constrain(vocabulary, lark_grammar(lark))


def checked(vocabulary: Vocabulary, tools: Tools, response_format: Mapping[str, Any] | None
            ) -> tuple[Mapping[str, Any], bool] | None:
    """Each function's schema and the response_format's compiled alone, so that one llguidance
    refuses is a ToolsError naming it; the response_format's (schema, strict), None without one."""
    answer = None
    if response_format is not None:
        try:
            constrain(vocabulary, grammar_text(response_format))
            answer = response_schema(response_format)
        except GrammarError as e:
            raise ToolsError(f"response_format: {e}", "response_format") from None
    for i, function in enumerate(tools.functions):
        param = f"tools.{i}.function.parameters"
        try:
            constrain(vocabulary, grammar_text({"type": "json_schema", "json_schema": {
                "schema": function.parameters, "strict": function.strict}}))
        except GrammarError as e:
            raise ToolsError(f"{param}: {e}", param) from None
    return answer


def special_ids(vocabulary: Vocabulary, markers: Sequence[str]) -> dict[str, int]:
    """Those of `markers` the vocabulary holds as special tokens -> their ids."""
    return {text: vocabulary.tokenizer.tokenize_str(text, parse_special=True)[0]
            for text in vocabulary.special(markers)}


def grammar(tools: Tools, syntax: Syntax, special: Mapping[str, int] | None = None,
            answer: tuple[Mapping[str, Any], bool] | None = None) -> str | None:
    """The reply's grammar, in llguidance's Lark; None where the reply is free text (choice none).
    Calls are Lark around one JSON schema per call (its arguments the function's schema, moved under
    $defs with its references); under `auto` text may come instead (GENERIC, LLAMA3: text not
    beginning as calls do) or before the calls (HERMES, MISTRAL: text up to the first trigger).
    special: the syntax's markers the vocabulary holds as special tokens (Qwen2.5's <tool_call>,
    Mistral's [TOOL_CALLS]) -> their ids, named by id: their text spelled out would be other tokens,
    which the model never writes. answer: (a JSON schema, strict), a response_format's: under `auto`
    the reply is calls or JSON under it, never free text (as OpenAI answers tools with a format)."""
    functions = tools.callable()
    if not functions:
        return None
    tokens = {text: f"<[{special[text]}]>" for text in syntax.markers if text in (special or {})}
    more = f" ({_lark(syntax.between, tokens)} call)*" if tools.parallel and syntax.between is not None else ""
    last = f"{_lark(syntax.last, tokens)} {json.dumps(ENDING)}?"
    calls = f"{_lark(syntax.first, tokens)} call{more} {last}"
    if tools.choice != "auto":
        lines = [f"start: {calls}"]
    elif answer is not None and syntax.opening == "{":  # calls that are JSON too: one schema, either
        return "\n".join(["%llguidance {}", f"start: reply {json.dumps(ENDING)}?",
                          f"reply: %json {json.dumps(_answer_or_calls(functions, syntax, tools.parallel, *answer))}"]
                         ) + "\n"
    elif answer is not None:
        schema, strict = answer
        lines = [f"start: answer | {calls}",
                 f"answer: %json {json.dumps(guided_json(schema, strict))}"]
    elif syntax.trigger is None:
        lines = [f"start: TEXT | {calls}", f"TEXT: /[^{_regex_escape(syntax.opening)}](.|\\n)*/"]
    elif syntax.trigger in tokens:  # text cannot hold a special token: it ends where the trigger comes
        lines = [f"start: TEXT | TEXT {calls}", "TEXT: /(.|\\n)*/"]
    else:  # text up to the first trigger, a lazy lexeme: the calls begin there
        rest = _lark(syntax.first[len(syntax.trigger):], tokens)
        lines = [f"start: TEXT | head {rest} call{more} {last}", "TEXT: /(.|\\n)*/",
                 f"head[lazy]: TEXT {_lark(syntax.trigger, tokens)}"]
    schema = _call_schema(functions, syntax.key)
    return "\n".join(["%llguidance {}", *lines, f"call: %json {json.dumps(schema)}"]) + "\n"


def _lark(text: str, tokens: Mapping[str, str]) -> str:
    """`text` as Lark: quoted strings, the special markers in it as their tokens (`tokens`: text ->
    Lark). Each line break is a string of its own: llguidance's lexer is greedy, so "\n</tool_call>"
    then ENDING's "\n" would be read as the start of "\n</tool_call>\n<tool_call>\n" (another call)
    and a reply ending there refused; as separate strings the two paths share their lexemes."""
    pattern = "|".join(["\n", *map(re.escape, sorted(tokens))])
    return " ".join(tokens[piece] if piece in tokens else json.dumps(piece)
                    for piece in re.split(f"({pattern})", text) if piece)


def _regex_escape(char: str) -> str:
    return "\\" + char if char in "\\^]-[/" else char


def _call_schema(functions: Sequence[Function], key: str) -> dict[str, Any]:
    """One call of any of `functions`: {"name": its name, <key>: under its schema}, on one line
    as json.dumps writes it (the grammar's JSON_OPTIONS); lenient unless every function is strict
    (each one's own strictness is checked when its schema is compiled alone)."""
    defs, calls = {}, []
    for i, function in enumerate(functions):
        where = f"#/$defs/arguments_{i}"
        defs[f"arguments_{i}"] = _moved(function.parameters, where)
        calls.append({"type": "object", "properties": {"name": {"const": function.name}, key: {"$ref": where}},
                      "required": ["name", key], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    options = {**JSON_OPTIONS, "lenient": not all(f.strict for f in functions)}
    return {**schema, "$defs": defs, "x-guidance": options}


def _answer_or_calls(functions: Sequence[Function], syntax: Syntax, parallel: bool, answer: Mapping[str, Any],
                     strict: bool) -> dict[str, Any]:
    """A reply that is JSON under `answer` or the calls, where the syntax writes calls as JSON too
    (GENERIC's object, LLAMA3's bare call): as one schema, since llguidance's greedy lexer cannot
    choose between a literal '{"tool_calls": [' and the answer's '{' by Lark alternatives."""
    call = _call_schema(functions, syntax.key)
    defs, options = call.pop("$defs"), call.pop("x-guidance")
    if syntax.holder is not None:
        call = {"type": "object", "properties": {syntax.holder: {
            "type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}},
            "required": [syntax.holder], "additionalProperties": False}
    return {"anyOf": [{"$ref": "#/$defs/answer"}, call], "$defs": {**defs, "answer": _moved(answer, "#/$defs/answer")},
            "x-guidance": {**options, "lenient": options["lenient"] or not strict}}


def _moved(schema: Any, where: str) -> Any:
    """`schema` placed at `where`: its references to its own root (#, #/...) made to point there."""
    if isinstance(schema, Mapping):
        return {key: (where + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                      else value if key in DATA_KEYWORDS else _moved(value, where))
                for key, value in schema.items()}
    if isinstance(schema, list):
        return [_moved(value, where) for value in schema]
    return schema


def guided_json(schema: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    """A schema as a grammar's %json takes it: on one line as json.dumps writes it (JSON_OPTIONS),
    keywords llguidance does not implement refused unless not strict."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}}
