"""gpt-oss's harmony format without a model: replies read back (whole, and streamed cut at every place),
the grammar of a forced call or answer, the prompt (history, reasoning effort) written through a
harmony template, the template told apart from others, and the tokens that end a generation.

Oracles: replies written out by hand as gpt-oss writes them (both places of a call's recipient, a
preamble, a reply cut short by the token budget) with their content, reasoning and calls stated;
the whole reading of each against every streamed reading; llguidance's own verdict on whole replies;
the tiny harmony template's text (tiny_harmony.py) for the history.
"""
from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from quickdraft.errors import ModelLoadError, RequestError
from quickdraft.model.families import FAMILIES
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.requests import reply
from quickdraft.requests.prompt import text_of
from quickdraft.structured import harmony
from quickdraft.structured.grammar import Vocabulary, constrain, lark_grammar
from quickdraft.structured.harmony_grammar import grammar
from quickdraft.structured.tool_reply import Call
from quickdraft.structured.tools import HARMONY, Function, Tools, special_ids, template_syntax
from quickdraft.weights import load_model
from quickdraft.weights.gguf_file import _end_token_ids
from quickdraft.weights.hf_dir import read_config
from tiny_harmony import HARMONY_SPECIAL, HARMONY_TEMPLATE, harmony_llm_dir, harmony_raw, harmony_tokenizer, token
from tiny_tokenizer import VOCAB_SIZE, build_tokenizer

WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}},
                                   "required": ["city"], "additionalProperties": False}, "A forecast")
TIME = Function("get_time", {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 3}},
                             "required": ["zone"], "additionalProperties": False})
ARGS = '{"city": "Oslo"}'
THINK = "<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|><|start|>assistant"

# (reply as gpt-oss writes it after the prompt's <|start|>assistant, content, reasoning, calls, complete)
REPLIES = [
    ("<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "It is 4.", "2 + 2 is 4.", [], False),
    (f"{THINK}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
     "", "The user wants the weather. I should call get_weather.", [Call("get_weather", ARGS)], True),
    # the recipient in the role's header, as the template writes earlier calls
    (f"{THINK} to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}",
     "", "The user wants the weather. I should call get_weather.", [Call("get_weather", ARGS)], True),
    (" to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": \"UTC\"}",
     "", "", [Call("get_time", '{"zone": "UTC"}')], True),
    # a preamble (commentary without a recipient) is content
    ("<|channel|>commentary<|message|>Let me look that up.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}", "Let me look that up.", "",
     [Call("get_weather", ARGS)], True),
    # cut short by max_tokens mid-reasoning, and mid-call
    ("<|channel|>analysis<|message|>Let me think about <b>this", "", "Let me think about <b>this", [], False),
    (f"{THINK}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{\"city\": \"Os",
     "", "The user wants the weather. I should call get_weather.", [Call("get_weather", '{"city": "Os')], False),
    ("<|channel|>analysis<|message|>Hm", "", "Hm", [], False),
    ("<|channel|>analy", "", "", [], False),  # a header cut short: no body yet
    # two analysis messages, one line apart; a built-in tool's call (never offered) is reasoning too
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.", "Done.", "First.\nSecond.", [], False),
    ('<|channel|>analysis to=browser.search code<|message|>{"query": "x"}', "", '{"query": "x"}', [], False),
    # gpt-oss-20b's stray recipient to=assistant, and text outside the format (a model that ignores it)
    ("<|channel|>commentary to=assistant<|channel|>final<|message|>Hi.", "Hi.", "", [], False),
    ("Plain text, no channels.", "Plain text, no channels.", "", [], False),
]


@pytest.mark.parametrize("text,content,reasoning,calls,complete", REPLIES)
def test_a_reply_reads_into_content_reasoning_and_calls(text, content, reasoning, calls, complete) -> None:
    got = harmony.read(text)
    assert (got.content, got.reasoning, got.calls, got.complete) == (content, reasoning, calls, complete)
    assert got.whole == (calls if complete else [])  # a call cut short is never handed on


def pieces(text: str) -> list[str]:
    """The text as a tokenizer would stream it: each marker whole, the rest a character at a time."""
    return [piece for part in harmony.PIECES.split(text) if part
            for piece in ([part] if part in harmony.MARKERS else list(part))]


def streamed(chunks: list[str]) -> harmony.Reply:
    reader = harmony.Reader()
    content, reasoning, calls = "", "", {}
    for i, chunk in enumerate(chunks):
        said_content, said_reasoning, said_calls = reader.feed(chunk, end=i == len(chunks) - 1)
        assert not any(marker in said_content + said_reasoning for marker in harmony.MARKERS)
        content, reasoning = content + said_content, reasoning + said_reasoning
        for piece in said_calls:
            name, arguments = calls.get(piece.index, (None, ""))
            assert (name is None) == (piece.name is not None), "a call's name comes once, first"
            calls[piece.index] = (name or piece.name, arguments + piece.arguments)
    return harmony.Reply(content, reasoning, [Call(*c) for _, c in sorted(calls.items())], reader.complete)


@pytest.mark.parametrize("text", [r[0] for r in REPLIES])
def test_streamed_cut_anywhere_reads_as_the_whole(text: str) -> None:
    whole = harmony.read(text)
    tokens = pieces(text)
    assert streamed(tokens) == whole  # token by token
    for cut in range(1, len(text)):   # and cut once at every character, markers too
        assert streamed([text[:cut], text[cut:]]) == whole, cut
    for cut in range(1, len(tokens)):  # held at a boundary, then the rest at the end
        assert streamed(["".join(tokens[:cut]), "", "".join(tokens[cut:])]) == whole, cut


def test_calls_are_reasoning_where_the_request_offers_no_tools() -> None:
    text = f"{THINK}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
    got = harmony.read(text, calls=False)
    assert (got.content, got.calls, got.reasoning.endswith(f"\n{ARGS}")) == ("", [], True)


def test_the_request_pipeline_reads_harmony_with_or_without_tools() -> None:
    text = REPLIES[1][0]
    offered = reply.read(HARMONY, Tools((WEATHER,), "auto"), text)
    assert (offered.calls, offered.complete, offered.reasoning) == ([Call("get_weather", ARGS)], True, REPLIES[1][2])
    none = reply.read(HARMONY, None, REPLIES[0][0])
    assert (none.content, none.reasoning, none.calls) == ("It is 4.", "2 + 2 is 4.", [])
    assert reply.parsed(HARMONY, None) and not reply.parsed(template_syntax(chatml()), None)


# -- the grammar -------------------------------------------------------------------------------------------

def accepts(tools: Tools | None, text: str, answer: tuple[dict, bool] | None = None) -> bool:
    """llguidance's verdict: the reply's grammar takes `text` whole."""
    tok = harmony_tokenizer()
    vocabulary = Vocabulary(tok, VOCAB_SIZE)
    lark = grammar(tools, special_ids(vocabulary, HARMONY.markers), answer)
    matcher = constrain(vocabulary, lark_grammar(lark)).matcher
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
FINAL_JSON = '<|channel|>final<|message|>{"rain": true}'
RAIN = ({"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"],
         "additionalProperties": False}, True)


def test_a_forced_call_is_one_call_under_its_schema_after_free_messages() -> None:
    required = Tools((WEATHER, TIME), "required")
    for text in (CALL, f"{THINK}{CALL}", CALL.replace(" <|constrain|>json", " json"),
                 f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{CALL}",
                 '<|channel|>commentary to=functions.get_time json<|message|>{"zone": "UTC"}'):
        assert accepts(required, text), text
    for text in ("<|channel|>final<|message|>Sunny.", CALL.replace("Oslo", "Rome"),
                 CALL.replace("get_weather", "get_wetter"), f" to=functions.get_weather<|channel|>commentary json"
                 f"<|message|>{ARGS}", f"{CALL}{CALL}", THINK):
        assert not accepts(required, text), text
    named = Tools((WEATHER, TIME), "function", "get_time")
    assert not accepts(named, CALL) and accepts(named, '<|channel|>commentary to=functions.get_time json<|message|>'
                                                      '{"zone": "CET"}')


def test_an_answer_under_a_response_format_is_json_on_the_final_channel() -> None:
    for text in (FINAL_JSON, f"{THINK}{FINAL_JSON}", FINAL_JSON.replace("final", "final <|constrain|>json")):
        assert accepts(None, text, RAIN), text
    for text in ("<|channel|>final<|message|>It rains.", '<|channel|>final<|message|>{"rain": 1}', CALL,
                 '<|channel|>commentary<|message|>{"rain": true}',
                 f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{FINAL_JSON}"):
        assert not accepts(None, text, RAIN), text  # (a preamble is content: it would break the JSON)


def test_auto_answers_text_or_calls_and_with_a_format_json_or_calls() -> None:
    auto = Tools((WEATHER,), "auto")
    assert accepts(auto, "<|channel|>final<|message|>Sunny.") and accepts(auto, f"{THINK}{CALL}")
    assert accepts(auto, FINAL_JSON, RAIN) and accepts(auto, CALL, RAIN)
    assert not accepts(auto, "<|channel|>final<|message|>Sunny.", RAIN)
    assert accepts(auto, f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{CALL}")
    assert not accepts(auto, f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{FINAL_JSON}", RAIN)
    assert grammar(Tools((WEATHER,), "none"), {}, None) is None and grammar(None, {}, None) is None


def test_markers_are_named_by_id_where_they_are_special() -> None:
    lark = grammar(Tools((WEATHER,), "required"), {"<|channel|>": 7, "<|message|>": 8}, None)
    assert 'reply: <[7]> ("commentary" " to=functions." call)' in lark and '"json" <[8]> arguments_0' in lark
    assert '"<|end|>"' in lark  # not special in that vocabulary: its text


# -- the prompt ---------------------------------------------------------------------------------------------

def chatml() -> Tokenizer:
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|im_end|>",
                                             chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))


def test_the_harmony_template_is_told_from_others_by_its_markers_and_channels() -> None:
    assert template_syntax(harmony_tokenizer()) is HARMONY
    assert template_syntax(chatml()) is not HARMONY
    plain = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=harmony_raw(), eos_token="<|return|>",
                                              chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert template_syntax(plain) is not HARMONY  # the tokens without a template that writes channels


CALLED = {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
TIMED = {"id": "call_y", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}


def test_history_calls_one_a_message_each_followed_by_its_result_reasoning_before_the_call() -> None:
    history = [{"role": "user", "content": "Weather and time?"},
               {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two calls.",
                "tool_calls": [CALLED, TIMED]},
               {"role": "tool", "tool_call_id": "call_x", "content": "-3 and snow"},
               {"role": "tool", "tool_call_id": "call_y", "content": "12:00"}]
    text = text_of(harmony_tokenizer(), HARMONY, history, Tools((WEATHER, TIME), "auto"))
    turns = text[text.index("<|start|>user"):]
    assert turns == (
        "<|start|>user<|message|>Weather and time?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two calls.<|end|>"  # the reasoning, not the preamble
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"-3 and snow"<|end|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>'
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|>'
        "<|start|>assistant")
    assert "type get_weather = (_: {" in text and "type get_time = (_: {" in text  # the tools, listed
    answered = [*history, {"role": "assistant", "content": "Snowing; noon.", "reasoning_content": "Done."},
                {"role": "user", "content": "Thanks"}]
    later = text_of(harmony_tokenizer(), HARMONY, answered, None)
    assert "Two calls." not in later and "Done." not in later  # reasoning of answered turns is dropped
    assert "<|start|>assistant<|channel|>final<|message|>Snowing; noon.<|end|>" in later


def test_reasoning_effort_reaches_the_template_and_is_checked() -> None:
    user = [{"role": "user", "content": "Hi"}]
    tok = harmony_tokenizer()
    assert "Reasoning: medium" in text_of(tok, HARMONY, user, None)
    assert "Reasoning: high" in text_of(tok, HARMONY, user, None, "high")
    for effort, says in (("max", "expected one of low, medium, high"), ("", "expected one of")):
        with pytest.raises(RequestError, match=says) as refused:
            text_of(tok, HARMONY, user, None, effort)
        assert refused.value.param == "reasoning_effort"
    with pytest.raises(RequestError, match="takes no reasoning effort") as refused:
        text_of(chatml(), template_syntax(chatml()), user, None, "low")
    assert (refused.value.param, refused.value.code) == ("reasoning_effort", "unsupported_parameter")
    with pytest.raises(RequestError, match="need string 'role'") as refused:
        text_of(tok, HARMONY, [{"content": "no role"}], None, "low")
    assert refused.value.param == "messages"


# -- what ends a generation ------------------------------------------------------------------------------------

def test_a_turn_ends_at_return_call_or_end_of_text_never_at_end() -> None:
    ends = {token("<|return|>"), token("<|call|>"), 0}  # <|endoftext|> is the tiny tokenizer's id 0
    assert reply.end_ids(harmony_tokenizer(), HARMONY) == ends
    # a checkpoint that names <|end|> its end of sequence still goes on past the reasoning's end
    assert reply.end_ids(harmony_tokenizer(extra_eos=(token("<|end|>"),)), HARMONY) == ends
    assert reply.end_ids(chatml(), template_syntax(chatml())) == chatml().eos_token_ids


def test_a_gpt_oss_gguf_ends_where_its_generation_config_says() -> None:
    tokens = ["a", *HARMONY_SPECIAL, "<|endoftext|>"]
    ends = _end_token_ids(tokens, FAMILIES["gpt_oss"])
    assert sorted(tokens[i] for i in ends) == ["<|call|>", "<|endoftext|>", "<|return|>"]


@pytest.mark.parametrize("calls", [True, False])
def test_reasoning_tokens_are_the_analysis_bodies_and_a_message_to_a_tool_not_offered(calls: bool) -> None:
    """Token by token: the analysis body's tokens; a message to functions.NAME is a call where tools are
    offered and reasoning where not (as Reader reads it); headers, markers and the answer are not."""
    tok = harmony_tokenizer()
    words = lambda text: len(tok.encode(text, add_special_tokens=False))
    reply = ("<|channel|>analysis<|message|>think it over<|end|><|start|>assistant to=functions.f"
             "<|channel|>commentary json<|message|>{\"a\": 1}<|call|>")
    counter = harmony.ReasoningTokens(calls)
    for token_id in tok.encode(reply, add_special_tokens=False):
        counter.feed(tok.decode([token_id], tok.markers_of(harmony.MARKERS)))
    assert counter.count == words("think it over") + (0 if calls else words('{"a": 1}'))


def test_a_checkpoint_ends_where_its_generation_config_says(tmp_path) -> None:
    """config.json names one end token; generation_config.json lists the others, which were dropped."""
    path = harmony_llm_dir(tmp_path / "m")
    ends = [token("<|return|>"), token("<|call|>"), 0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    assert read_config(path).eos_token_ids == tuple(ends)
    assert set(ends) <= load_model(str(path)).tokenizer.eos_token_ids
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|call|>"]}))
    with pytest.raises(ModelLoadError, match="eos_token_id must be a token id or a list of them"):
        read_config(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ends[0], 10**6]}))
    with pytest.raises(ModelLoadError, match=r"eos_token_id 1000000 is past the model's vocabulary \(vocab_size"):
        read_config(path)


def test_the_tiny_template_writes_what_the_format_says() -> None:
    """The test template itself: the system message, tools as a namespace, the generation prompt."""
    text = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=harmony_raw(), chat_template=HARMONY_TEMPLATE)) \
        .chat_text([{"role": "user", "content": "Hi"}], tools=[WEATHER.as_tool()])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and text.endswith("<|start|>assistant")
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert "## functions\n\nnamespace functions {\n\n// A forecast\ntype get_weather = (_: {\ncity: any,\n}) => any;" \
        in text
