"""Tool calling's parts without a server: the template's syntax found by probing it, the prompt
(tools and history, native or generic), the reply's grammar, the reply read back (whole and streamed
piece by piece), and greedy decoding under a tool grammar identical for every proposer.

Oracles: texts written out by hand; llguidance's own verdict on strings the grammar must take or
refuse; the whole reading of a reply against its streamed reading; jsonschema's validator for every
call's arguments; constrained plain decoding through the same engine. Tiny tokenizer and models.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from quickdraft.model.tokenizer import Tokenizer
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.conversation import conversation, instructions
from quickdraft.structured.grammar import constrain, lark_grammar
from quickdraft.structured.tool_reply import Call, CallPiece, Reader, calls_of, read
from quickdraft.structured.tools import GENERIC, HERMES, MISTRAL, Tools, grammar, syntax_of
from support.grammar import PROPOSERS, run, text, tokenizer, vocabulary
from support.tools import FUNCTIONS, HISTORY, OSLO, UTC, WEATHER, call_json
from tiny_tokenizer import CHATML, EOS, build_tokenizer

# a Hermes-style template (as Qwen2.5's writes tools, calls and results), written for these tests
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def template_tokenizer(template: str) -> Tokenizer:
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token=EOS, chat_template=template))


def render(template: str):
    tok = template_tokenizer(template)
    return lambda messages, tools: tok.chat_text(messages, tools=tools)


def generic_reply(*calls: tuple[str, dict]) -> str:
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def hermes_reply(*calls: tuple[str, dict], before: str = "") -> str:
    return before + "\n".join(f"<tool_call>\n{call_json(n, a)}\n</tool_call>" for n, a in calls)


# -- the template's syntax, and the prompt -------------------------------------------------------------------

def test_a_template_that_writes_hermes_calls_is_native_and_chatml_is_generic() -> None:
    assert syntax_of(render(HERMES_TEMPLATE)) is HERMES
    assert syntax_of(render(CHATML)) is GENERIC
    without_results = HERMES_TEMPLATE.replace("{{ m.content }}\n</tool_response>", "\n</tool_response>")
    assert syntax_of(render(without_results)) is GENERIC  # a result it drops: not trusted with the history

    def broken(messages, tools):
        raise RuntimeError("a template that raises")
    assert syntax_of(broken) is GENERIC


def test_generic_prompt_lists_the_tools_in_the_system_turn_and_writes_the_history_as_json() -> None:
    tools = Tools(FUNCTIONS, "auto")
    messages, listed = conversation(HISTORY, tools, GENERIC)
    assert listed is None
    assert messages[0] == {"role": "system", "content": instructions(tools)}
    assert '"name": "get_weather"' in messages[0]["content"] and "The weather in a city" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": generic_reply(("get_weather", {"city": "Oslo", "unit": "c"}))}
    assert json.loads(messages[3]["content"]) == {"tool_response": {"name": "get_weather", "content": "-3 and snow"}}
    assert messages[3]["role"] == "user"
    system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    assert conversation(system, tools, GENERIC)[0][0]["content"] == "Be brief.\n\n" + instructions(tools)
    # choice none: no tools listed, the history still written as JSON
    messages, _ = conversation(HISTORY, Tools(FUNCTIONS, "none"), GENERIC)
    assert messages[0] == HISTORY[0] and messages[1]["content"].startswith('{"tool_calls": [')
    # the whole prompt, through the template that knows no tools
    text = template_tokenizer(CHATML).chat_text(*conversation(HISTORY, tools, GENERIC)[:1])
    assert text.startswith("<|im_start|>system\nYou can call these tools:") and "-3 and snow" in text


def test_native_prompt_passes_tools_and_the_history_with_arguments_as_objects() -> None:
    messages, listed = conversation(HISTORY, Tools(FUNCTIONS, "required"), HERMES)
    assert listed == [f.as_tool() for f in FUNCTIONS]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "c"}
    assert messages[0] == HISTORY[0] and messages[2] == {**HISTORY[2], "tool_call_id": "call00000"}
    assert messages[1]["tool_calls"][0]["id"] == "call00000"  # positional: the client's random id never shown
    text = template_tokenizer(HERMES_TEMPLATE).chat_text(messages, tools=listed)
    assert hermes_reply(("get_weather", {"city": "Oslo", "unit": "c"})) in text  # as the model is to write it
    assert '"name": "book"' in text and "-3 and snow" in text
    assert conversation(HISTORY, Tools(FUNCTIONS, "none"), HERMES)[1] is None


# -- the grammar ------------------------------------------------------------------------------------------

def accepts(tools: Tools, syntax, reply: str) -> bool:
    """Whether the reply's grammar takes `reply` as a whole reply (llguidance's verdict)."""
    matcher = constrain(vocabulary(), lark_grammar(grammar(tools, syntax))).matcher
    tokens = tokenizer().encode(reply, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


GUESTS = ("book", {"guests": [{"name": "Ada"}, {"name": "Bo"}]})


@pytest.mark.parametrize("syntax,write", [(GENERIC, generic_reply), (HERMES, hermes_reply)])
def test_the_grammar_takes_calls_under_their_schemas_and_refuses_the_rest(syntax, write) -> None:
    required, auto = Tools(FUNCTIONS, "required"), Tools(FUNCTIONS, "auto")
    for calls in ((OSLO,), (UTC,), (GUESTS,), (OSLO, UTC, GUESTS)):
        assert accepts(required, syntax, write(*calls)) and accepts(auto, syntax, write(*calls)), calls
    for bad in (("get_weather", {"city": "Oslo"}),                       # a required argument missing
                ("get_weather", {"city": "Oslo", "unit": "k"}),          # outside the enum
                ("get_time", {"zone": "utc"}),                           # against the pattern
                ("book", {"guests": [{"name": "Ada", "age": 3}]}),       # through $ref: no extra keys
                ("get_date", {})):                                       # no such function
        assert not accepts(required, syntax, write(bad)), bad
    assert not accepts(required, syntax, "It is sunny.")
    assert accepts(auto, syntax, "It is sunny.\nNo tool needed.")
    named = Tools(FUNCTIONS, "function", "get_time")
    assert accepts(named, syntax, write(UTC)) and not accepts(named, syntax, write(OSLO))
    single = Tools(FUNCTIONS, "required", parallel=False)
    assert accepts(single, syntax, write(OSLO)) and not accepts(single, syntax, write(OSLO, UTC))
    assert grammar(Tools(FUNCTIONS, "none"), syntax) is None


@pytest.mark.parametrize("syntax,write", [(GENERIC, generic_reply), (HERMES, hermes_reply)])
@pytest.mark.parametrize("tools", [Tools(FUNCTIONS, "required"), Tools(FUNCTIONS, "function", "get_weather"),
                                   Tools(FUNCTIONS, "auto")])
def test_a_reply_may_end_after_any_call_and_its_line_break(syntax, write, tools) -> None:
    """Qwen2.5 writes "\n" after </tool_call> and then its end token: with parallel calls allowed the
    grammar let only another call follow that line break, and the model was made to call again."""
    for calls in ((OSLO,), (OSLO, OSLO)):
        assert accepts(tools, syntax, write(*calls) + "\n"), calls  # accepting: the end token may come
        assert not accepts(tools, syntax, write(*calls) + "\n\n")    # one line break, not a run of them
    content, pieces = Reader(tools, syntax).feed(write(OSLO) + "\n", end=True)
    assert content == "" and [c.name for c in calls_of(pieces)] == ["get_weather"]  # the break is not text


ANSWER = ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
           "required": ["city", "rain"], "additionalProperties": False}, True)  # a response_format's (schema, strict)


def answers(tools: Tools, syntax, reply: str) -> bool:
    """accepts(), the grammar written with ANSWER as the response_format."""
    matcher = constrain(vocabulary(), lark_grammar(grammar(tools, syntax, None, ANSWER))).matcher
    tokens = tokenizer().encode(reply, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


@pytest.mark.parametrize("syntax,write", [(GENERIC, generic_reply), (HERMES, hermes_reply)])
def test_tools_with_a_response_format_answer_calls_or_json_under_its_schema(syntax, write) -> None:
    auto, required = Tools(FUNCTIONS, "auto"), Tools(FUNCTIONS, "required")
    json_answer = json.dumps({"city": "Oslo", "rain": True})
    assert answers(auto, syntax, write(OSLO)) and answers(auto, syntax, write(OSLO, UTC))
    assert answers(auto, syntax, json_answer)
    assert not answers(auto, syntax, "It is sunny.")                                # free text: not the format
    assert not answers(auto, syntax, json.dumps({"city": "Oslo"}))                  # JSON off the schema
    assert not answers(auto, syntax, json.dumps({"city": "Oslo", "rain": True, "x": 1}))
    assert answers(required, syntax, write(OSLO)) and not answers(required, syntax, json_answer)


def test_a_call_cut_short_is_not_handed_on_as_a_call() -> None:
    reply = read(Tools(FUNCTIONS, "required"), HERMES, hermes_reply(OSLO, UTC)[:-20])
    assert not reply.complete and [c.name for c in reply.calls] == ["get_weather", "get_time"]
    assert [c.name for c in reply.whole] == ["get_weather"]
    whole = read(Tools(FUNCTIONS, "required"), HERMES, hermes_reply(OSLO, UTC))
    assert whole.complete and whole.whole == whole.calls and len(whole.calls) == 2


def test_auto_text_before_calls_only_where_the_syntax_has_it() -> None:
    auto = Tools(FUNCTIONS, "auto")
    assert accepts(auto, HERMES, hermes_reply(OSLO, before="Let me look.\n"))
    assert not accepts(auto, HERMES, "Let me look.\n<tool_call>\nhello\n</tool_call>")  # past the trigger: a call
    assert not accepts(auto, GENERIC, '{"answer": 1}')  # text never begins as calls do
    assert accepts(auto, GENERIC, "Let me look.\n" + generic_reply(OSLO))  # text (read back as text)


# -- the reply, read back -----------------------------------------------------------------------------------

CUT = generic_reply(OSLO, UTC)[:-12]
REPLIES = [  # (tools, syntax, reply, content, calls, complete)
    (Tools(FUNCTIONS, "required"), GENERIC, generic_reply(OSLO, GUESTS), "",
     [Call("get_weather", '{"city": "Oslo", "unit": "c"}'), Call("book", json.dumps(GUESTS[1]))], True),
    (Tools(FUNCTIONS, "auto"), GENERIC, "Sunny {all} day", "Sunny {all} day", [], False),
    (Tools(FUNCTIONS, "auto"), GENERIC, generic_reply(UTC), "", [Call("get_time", '{"zone": "UTC"}')], True),
    (Tools(FUNCTIONS, "auto"), HERMES, hermes_reply(OSLO, UTC, before="Checking <tool> now.\n"),
     "Checking <tool> now.\n", [Call("get_weather", '{"city": "Oslo", "unit": "c"}'),
                                Call("get_time", '{"zone": "UTC"}')], True),
    (Tools(FUNCTIONS, "auto"), HERMES, "No calls: <tool_cal", "No calls: <tool_cal", [], False),
    (Tools((WEATHER,), "required"), HERMES,
     hermes_reply(("get_weather", {"city": "a \"}\\ {[", "unit": "f"})), "",
     [Call("get_weather", json.dumps({"city": "a \"}\\ {[", "unit": "f"}))], True),
    # cut short (the token budget): the call begun stays unfinished, its head passed on as text
    (Tools(FUNCTIONS, "required"), GENERIC, CUT, "",
     [Call("get_weather", '{"city": "Oslo", "unit": "c"}'), Call("get_time", CUT.split('"arguments": ')[-1])], False),
    (Tools(FUNCTIONS, "required"), GENERIC, '{"tool_calls": [{"na', '{"na', [], False),
    # under auto, a reply that is a bare JSON call of a listed function (as small models write them)
    (Tools(FUNCTIONS, "auto"), HERMES, call_json(*OSLO), "", [Call("get_weather", json.dumps(OSLO[1]))], True),
    (Tools(FUNCTIONS, "auto"), HERMES, "\n" + json.dumps({"name": "get_time", "parameters": UTC[1]}) + "\n", "",
     [Call("get_time", json.dumps(UTC[1]))], True),
    (Tools(FUNCTIONS, "auto"), MISTRAL, call_json(*UTC), "", [Call("get_time", json.dumps(UTC[1]))], True),
    # ... and JSON that only looks like one: text
    (Tools(FUNCTIONS, "auto"), HERMES, call_json("get_date", {}), call_json("get_date", {}), [], False),
    (Tools(FUNCTIONS, "function", "get_time"), HERMES, call_json(*UTC), call_json(*UTC), [], False),
    (Tools(FUNCTIONS, "auto"), HERMES, '{"name": "get_time", "answer": 1}', '{"name": "get_time", "answer": 1}', [],
     False),
    (Tools(FUNCTIONS, "auto"), HERMES, '{"name": ["get_time"], "arguments": {}}', '{"name": ["get_time"], "arguments": {}}',
     [], False),
    (Tools(FUNCTIONS, "auto"), HERMES, '{"name": "get_time", "arguments": "UTC"}',
     '{"name": "get_time", "arguments": "UTC"}', [], False),
    (Tools(FUNCTIONS, "auto"), HERMES, call_json(*UTC) + " is the call", call_json(*UTC) + " is the call", [], False),
    (Tools(FUNCTIONS, "auto"), HERMES, "I'd call " + call_json(*UTC), "I'd call " + call_json(*UTC), [], False),
    (Tools(FUNCTIONS, "auto"), HERMES, '{"name": "get_ti', '{"name": "get_ti', [], False),
]


@pytest.mark.parametrize("tools,syntax,reply,content,calls,complete", REPLIES)
def test_a_reply_reads_the_same_whole_and_streamed(tools, syntax, reply, content, calls, complete) -> None:
    whole = Reader(tools, syntax)
    got, pieces = whole.feed(reply, end=True)
    assert (got, calls_of(pieces), whole.complete) == (content, calls, complete)
    for step in (1, 3, 7):
        streamed, texts, all_pieces = Reader(tools, syntax), [], []
        for i in range(0, len(reply), step):
            t, p = streamed.feed(reply[i:i + step])
            texts.append(t)
            all_pieces += p
        t, last = streamed.feed("", end=True)
        all_pieces += last
        assert "".join(texts) + t == content and calls_of(all_pieces) == calls and streamed.complete == complete
        named = [piece for piece in all_pieces if piece.name is not None]
        assert [p.index for p in named] == list(range(len(calls)))  # a call's name comes once, first


def test_text_that_may_begin_a_call_is_held_back_until_it_does_not() -> None:
    reader = Reader(Tools(FUNCTIONS, "auto"), HERMES)
    assert reader.feed("Hi <tool") == ("Hi ", [])
    assert reader.feed("s> ok") == ("<tools> ok", [])
    assert reader.feed("<tool_call>\n") == ("", [])
    content, pieces = reader.feed('{"name": "get_time", "arguments": {"zo')
    assert content == "" and [(p.index, p.name, p.arguments) for p in pieces] == [(0, "get_time", '{"zo')]
    # a reply beginning with "{" may be a bare call: held back until it is whole and is not one ...
    reader = Reader(Tools(FUNCTIONS, "auto"), HERMES)
    assert reader.feed(' {"name": "get_time", ') == ("", [])
    assert reader.feed('"answer": 1}') == (' {"name": "get_time", "answer": 1}', [])
    assert reader.feed(call_json(*UTC)) == (call_json(*UTC), [])  # text once text was said
    # ... or until the reply ends, when it is one
    reader = Reader(Tools(FUNCTIONS, "auto"), HERMES)
    assert reader.feed(call_json(*UTC)) == ("", [])
    assert reader.feed("", end=True) == ("", [CallPiece(0, "get_time", '{"zone": "UTC"}')]) and reader.complete


# -- greedy under a tool grammar: every proposer gives constrained plain decoding's tokens ---------------------

def tool_constraint(tools: Tools, syntax):
    return constrain(vocabulary(), lark_grammar(grammar(tools, syntax)))


def prompt_for(tools: Tools, syntax) -> list[int]:
    """A prompt holding calls, so prompt lookup finds keys and punctuation to draft."""
    example = generic_reply(OSLO, UTC) if syntax is GENERIC else hermes_reply(OSLO, UTC)
    return tokenizer().encode(f"Call like this: {example}\nNow: ", add_special_tokens=False)


CASES = [(Tools(FUNCTIONS, "required"), GENERIC), (Tools(FUNCTIONS, "function", "book"), HERMES),
         (Tools(FUNCTIONS, "auto"), HERMES), (Tools(FUNCTIONS, "required", parallel=False), HERMES)]
GREEDY = SamplingParams(max_new_tokens=160)


@pytest.mark.parametrize("method", [m for m in PROPOSERS if m != "plain"])
def test_greedy_speculation_under_tools_equals_constrained_plain_decoding(method: str) -> None:
    plain = [run([(prompt_for(t, s), GREEDY, "plain", tool_constraint(t, s))], 1) for t, s in CASES]
    for (tools, syntax), ((expected,), (reason,)) in zip(CASES, plain):
        (spec,), (spec_reason,) = run([(prompt_for(tools, syntax), GREEDY, method, tool_constraint(tools, syntax))], 1)
        assert (spec, spec_reason) == (expected, reason), (method, text(spec), text(expected))
        content, pieces = (reader := Reader(tools, syntax)).feed(text(spec), end=True)
        calls = calls_of(pieces)
        if tools.choice != "auto":  # calls only; a random model may go on calling until max_new_tokens
            # complete calls may still be cut by the context before the end token (the grammar's ENDING may follow)
            assert content == "" and reason in ("stop", "length") if reader.complete else reason == "length", \
                text(spec)
            calls = calls if reader.complete else calls[:-1]
        functions = {f.name: f for f in tools.callable()}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), functions[call.name].parameters)
    jobs = [(prompt_for(t, s), GREEDY, m, tool_constraint(t, s)) for t, s in CASES for m in ("plain", method)]
    batched, _ = run(jobs, 3)
    assert batched == [p[0][0] for p in plain for _ in range(2)]


def test_generic_prompt_names_tool_results_without_their_random_ids() -> None:
    """Clients make call ids at random: the prompt (hence the answer and the prefix cache) must not
    change with them; where one turn made several calls, results are told apart by position."""
    renamed = json.loads(json.dumps(HISTORY).replace("call_1", "call_zq81"))
    assert conversation(renamed, None, GENERIC)[0] == conversation(HISTORY, None, GENERIC)[0]
    two = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [
               {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
               for i in (7, 3)]},
           {"role": "tool", "tool_call_id": "c3", "content": "a"}, {"role": "tool", "tool_call_id": "c7", "content": "b"}]
    turns = conversation(two, None, GENERIC)[0]
    assert [json.loads(t["content"])["tool_response"]["call"] for t in turns[2:]] == [1, 0]


def test_the_server_and_the_python_api_render_one_chat_the_same() -> None:
    """One rendering of a chat (conversation.conversation over template_message): a server body (pydantic,
    text parts, the developer role, null content beside calls) gives the template the messages the
    Python API's dicts give it; a part that is not text is refused by name, not a traceback."""
    from quickdraft.errors import QuickdraftError
    from quickdraft.server.schemas import ChatCompletionRequest
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                HISTORY[0], {**HISTORY[1], "content": None}, HISTORY[2]]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    tools = Tools(FUNCTIONS, "auto")
    for syntax in (GENERIC, HERMES):
        assert conversation(body.chat(), tools, syntax) == conversation(messages, tools, syntax)
    turns, _ = conversation(messages, None, HERMES)
    assert turns[0] == {"role": "system", "content": "Be brief."}
    assert [t["content"] for t in turns if t.get("tool_calls")] == [""]  # OpenAI's null beside the calls
    with pytest.raises(QuickdraftError, match="image_url"):
        conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None, HERMES)
