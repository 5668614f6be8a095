"""A chat as the model's template takes it: OpenAI's messages (from the server's bodies and the
Python API's dicts alike) with their text and roles normalized, earlier tool calls and results in
the template's syntax (tools.py `Syntax`: native, or llama.cpp's generic JSON with the tools listed
in the system turn), and the ids of the calls a reply makes. The one rendering every front door
uses (routes, the Python API, the cluster's front).
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from quickdraft.errors import QuickdraftError
from quickdraft.structured.tools import Syntax, Tools, positional_id


def call_id(request_id: str, index: int) -> str:
    """The id of a reply's call `index`, as OpenAI's: unique per request (prompts never show it:
    conversation numbers earlier calls by position)."""
    return f"call_{request_id}_{index}"


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as chat templates take it, from the server's bodies and the Python
    API's dicts alike: its content as text (text parts joined; the null content OpenAI's history
    leaves beside an assistant's calls, empty) and "developer", OpenAI's newer name for the system
    role, as "system", the one templates know."""
    _check_calls(message.get("tool_calls"))
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        if (odd := next((p for p in content if not isinstance(p, Mapping) or p.get("type") != "text"
                         or not isinstance(p.get("text"), str)), None)):
            raise QuickdraftError(f"a message's content is text or a list of text parts "
                                  f"({{\"type\": \"text\", \"text\": ...}}), found the part {odd!r}")
        return template_message({**message, "content": "".join(part["text"] for part in content)})
    if content is None and message.get("tool_calls"):
        return template_message({**message, "content": ""})
    return {**message, "role": "system"} if message.get("role") == "developer" else dict(message)


def _check_calls(calls: Any) -> None:
    """An assistant's earlier calls as OpenAI writes them (the server's bodies are checked by their
    schema; the Python API's dicts here): a list of {"function": {"name", "arguments"}}."""
    if calls is None:
        return
    if isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
        raise QuickdraftError(f"a message's tool_calls is a list of calls, found {type(calls).__name__}")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise QuickdraftError(f"tool_calls[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": "
                                  f"..., \"arguments\": ...}}}}, found {call!r}")
        if not isinstance(function.get("arguments", ""), (str, Mapping)):
            raise QuickdraftError(f"tool_calls[{i}].function.arguments: expected JSON text or an object, found "
                                  f"{type(function['arguments']).__name__}")


def conversation(messages: Sequence[Mapping[str, Any]], tools: Tools | None, syntax: Syntax
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the chat template takes them, each message as template_message writes it.
    Native: earlier calls' arguments are objects (templates write them with tojson; OpenAI sends JSON
    text), their ids positional; harmony's, one call a message (_harmony_turns). GENERIC: the tools and how to call them in the system turn (unless
    choice none), earlier calls and tool results as JSON text in their turns."""
    messages = [template_message(m) for m in messages]
    listed = tools.functions if tools is not None and tools.choice != "none" else ()
    if syntax.channels:
        return _harmony_turns(_native_turns(messages)), [f.as_tool() for f in listed] or None
    if syntax.native:
        return _native_turns(messages), [f.as_tool() for f in listed] or None
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


def _native_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a native template takes them: calls' arguments objects, each call's id its place in
    the conversation (positional_id), a tool result's the id of the latest call it names."""
    turns: list[dict[str, Any]] = []
    ids: dict[Any, str] = {}
    made = 0  # calls so far
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                ids[call.get("id")], made = positional_id(made), made + 1
                calls.append({**call, "id": ids[call.get("id")],
                              "function": {**call["function"], "arguments": _arguments(call)}})
            turns.append({**message, "tool_calls": calls})
        elif message.get("role") == "tool" and message.get("tool_call_id") in ids:
            turns.append({**message, "tool_call_id": ids[message["tool_call_id"]]})
        else:
            turns.append(dict(message))
    return turns


def _harmony_turns(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Native turns as harmony's template takes them (gpt-oss's writes one call a message and names a
    tool's result after the latest call): each call a message of its own, followed by its result; an
    assistant's reasoning (reasoning_content, as replies carry it) its call's `thinking`, which the
    template writes before a call that no answer follows yet (gpt-oss goes on from that reasoning).
    The template takes a call's thinking or its content, never both: with reasoning, a call's content
    (a preamble) is left out."""
    results = {turn["tool_call_id"]: turn for turn in turns if turn.get("role") == "tool" and "tool_call_id" in turn}
    moved: set[str] = set()
    written: list[dict[str, Any]] = []
    for turn in turns:
        if turn.get("role") == "tool" and turn.get("tool_call_id") in moved:
            continue
        if turn.get("role") != "assistant":
            written.append(turn)
            continue
        calls, reasoning = turn.get("tool_calls") or [], turn.get("reasoning_content")
        rest = {key: value for key, value in turn.items() if key not in ("tool_calls", "reasoning_content")}
        if not calls:  # an answer: the template drops its reasoning
            written.append(rest)
            continue
        first = {**rest, "tool_calls": calls[:1], **({"thinking": reasoning, "content": ""} if reasoning else {})}
        for i, call in enumerate(calls):
            written.append(first if i == 0 else {"role": "assistant", "content": "", "tool_calls": [call]})
            if len(calls) > 1 and call["id"] in results:
                written.append(results[call["id"]])
                moved.add(call["id"])
    return written


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
