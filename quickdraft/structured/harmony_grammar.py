"""The grammar a harmony reply (tools.HARMONY; harmony.py reads it back) is written under where the
request constrains it: its call (tool_choice required or a function, and auto, so that a call's
arguments always follow its function's schema, as on every other model) and its answer (a
response_format's JSON on the final channel). The messages before it are the model's own, any
number, their text free: analysis (reasoning), and commentary (preambles) where the reply may call
and no format asks for JSON (a preamble is content: before a JSON answer it would break it). One call a reply: <|call|> ends
the turn, so the grammar ends with the call's JSON and the engine stops there. In llguidance's Lark,
harmony's markers named by token id (the model's trained tokens; spelled out, they would be text).
Knows the format and the grammar library, not the tokenizer or the engine.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from quickdraft.structured.grammar import (
    Constraint,
    GrammarError,
    Vocabulary,
    constrain,
    grammar_text,
    lark_grammar,
    response_schema,
)
from quickdraft.structured.harmony import CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, START
from quickdraft.structured.tools import HARMONY, Tools, checked, guided_json, special_ids


def harmony_constraint(vocabulary: Vocabulary, tools: Tools | None, response_format: Mapping[str, Any] | None
                       ) -> Constraint | None:
    """The reply's constraint (None: free), its schemas compiled alone first so that one llguidance
    refuses is an error naming its field (tools.checked; a response_format's alone, a GrammarError)."""
    if tools is not None:
        answer = checked(vocabulary, tools, response_format)
    elif response_format is not None:
        try:
            constrain(vocabulary, grammar_text(response_format))
        except GrammarError as e:
            raise GrammarError(str(e), "response_format") from None
        answer = response_schema(response_format)
    else:
        return None
    lark = grammar(tools, special_ids(vocabulary, HARMONY.markers), answer)
    return None if lark is None else constrain(vocabulary, lark_grammar(lark))


def grammar(tools: Tools | None, special: Mapping[str, int], answer: tuple[Mapping[str, Any], bool] | None
            ) -> str | None:
    """The reply's grammar in llguidance's Lark, None where it is free (no call to make, no format):
    free messages, then the reply: a call of one of the functions it may call (its name in the
    channel's header, as gpt-oss writes it, `<|constrain|>json` or `json` after it), or an answer on
    the final channel (JSON under `answer`, a response_format's (schema, strict); under auto without
    one, free text). special: harmony's markers the vocabulary holds as special tokens -> their ids."""
    functions = tools.callable() if tools is not None else ()
    if not functions and answer is None:
        return None
    channel, message, end, start, constrain_ = (f"<[{special[m]}]>" if m in special else json.dumps(m)
                                                for m in (CHANNEL, MESSAGE, END, START, CONSTRAIN))
    replies = [f'"commentary" " to={FUNCTIONS}" call'] if functions else []
    if answer is not None:
        replies.append(f'"final" (" " {constrain_}? "json")? {message} answer')
    elif tools is not None and tools.choice == "auto":
        replies.append(f'"final" {message} TEXT')
    steps = '("analysis" | "commentary")' if functions and answer is None else '"analysis"'
    lines = ["%llguidance {}", "start: step* reply",
             f'step: {channel} {steps} {message} TEXT {end} {start} "assistant"',
             f"reply: {channel} ({' | '.join(replies)})", "TEXT: /(.|\\n)*/"]
    if functions:
        lines.append("call: " + " | ".join(f'{json.dumps(f.name)} " " {constrain_}? "json" {message} arguments_{i}'
                                           for i, f in enumerate(functions)))
        lines += [f"arguments_{i}: %json {json.dumps(guided_json(f.parameters, f.strict))}" for i, f in enumerate(functions)]
    if answer is not None:
        lines.append(f"answer: %json {json.dumps(guided_json(*answer))}")
    return "\n".join(lines) + "\n"

