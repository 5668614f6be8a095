"""Tools through the Python API (LLM.generate) on a tiny random model whose template knows no tools
(the generic syntax): the calls parsed beside the text, the same under every proposer, a tool result
continuing the conversation, bad tool fields refused by name.

Oracles: jsonschema's validator for each call's arguments; the raw text the model wrote (the calls
read from it by hand); greedy plain decoding for speculation's; the same request without tools
for tool_choice none; the prompt the history renders to (decoded) for the tool result.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import quickdraft
from quickdraft.proposers import SpecConfig
from quickdraft.spec.sampling import SamplingParams
from quickdraft.structured.grammar import GrammarError
from quickdraft.structured.tools import GENERIC, ToolsError
from support.tools import TIME, WEATHER
from tiny_tokenizer import tiny_llm_dir

TOOLS = [f.as_tool() for f in (WEATHER, TIME)]
SCHEMAS = {f.name: f.parameters for f in (WEATHER, TIME)}
USER = [{"role": "user", "content": "Weather in Oslo?"}]

PARAMS = SamplingParams(max_new_tokens=300)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    root: Path = tmp_path_factory.mktemp("tools_api")
    target = tiny_llm_dir(root / "target", max_position_embeddings=2048)
    draft = tiny_llm_dir(root / "draft", seed=3, max_position_embeddings=2048)
    return quickdraft.load(str(target), spec=SpecConfig(method="none", draft_model=str(draft)))


def specs(llm: quickdraft.LLM) -> list[SpecConfig]:
    draft = llm.spec.draft_model
    return [SpecConfig(method="none"), SpecConfig("ngram", k=6), SpecConfig("ngram-tree", k=8),
            SpecConfig("draft", k=3, draft_model=draft), SpecConfig("draft-tree", k=6, draft_model=draft)]


@pytest.mark.parametrize("tool_choice,parallel", [("required", None), ("required", False),
                                                  ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_calls_come_back_parsed_and_the_same_under_every_proposer(llm: quickdraft.LLM, tool_choice, parallel) -> None:
    assert llm.tool_syntax() is GENERIC
    replies = [llm.generate(messages=USER, params=PARAMS, spec=spec, tools=TOOLS, tool_choice=tool_choice,
                            parallel_tool_calls=parallel) for spec in specs(llm)]
    plain = replies[0]
    assert plain.finish_reason == "tool_calls" and plain.content == "" and plain.tool_calls, plain.text
    written = json.loads(plain.text)["tool_calls"]  # the raw text: the generic syntax's one JSON object
    assert [(c.name, c.arguments) for c in plain.tool_calls] == [(c["name"], c["arguments"]) for c in written]
    for call in plain.tool_calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    assert parallel is not False or len(plain.tool_calls) == 1
    assert isinstance(tool_choice, str) or {c.name for c in plain.tool_calls} == {"get_time"}
    assert len({c.id for c in plain.tool_calls}) == len(plain.tool_calls)
    for other in replies[1:]:
        assert (other.token_ids, other.tool_calls and [(c.name, c.arguments) for c in other.tool_calls]) == \
            (plain.token_ids, [(c.name, c.arguments) for c in plain.tool_calls])


def test_the_stream_reads_the_calls_as_generate_does(llm: quickdraft.LLM) -> None:
    """LLM.stream's chunks carry the calls' pieces as they come: their names in order, each call's
    joined arguments the arguments generate parses from the same text."""
    whole = llm.generate(messages=USER, params=PARAMS, tools=TOOLS, tool_choice="required")
    chunks = list(llm.stream(messages=USER, params=PARAMS, tools=TOOLS, tool_choice="required"))
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.content for c in chunks) == whole.content == ""
    calls: dict[int, list[str]] = {}
    for piece in (p for c in chunks for p in c.tool_calls):
        calls.setdefault(piece.index, [piece.name]).append(piece.arguments)
    assert [(name, json.loads("".join(parts))) for name, *parts in calls.values()] == \
        [(c.name, c.arguments) for c in whole.tool_calls]
    assert sum(bool(c.tool_calls) for c in chunks[:-1]) > 1  # the pieces as they come, not at the end


def test_a_tool_result_continues_the_conversation(llm: quickdraft.LLM) -> None:
    first = llm.generate(messages=USER, params=PARAMS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.tool_calls[0]
    assert first.message == {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]}
    history = [*USER, first.message, {"role": "tool", "tool_call_id": call.id, "content": "-3 and snow"}]
    prompt = llm.tokenizer.decode(llm.prompt_ids(messages=history))
    assert json.dumps({"tool_response": {"name": call.name, "content": "-3 and snow"}}) in prompt
    assert json.dumps({"tool_calls": [{"name": call.name, "arguments": call.arguments}]}) in prompt
    answer = llm.generate(messages=history, params=SamplingParams(max_new_tokens=20), tools=TOOLS, tool_choice="none")
    assert answer.tool_calls == [] and answer.content == answer.text
    # OpenAI's history: content null beside the calls, arguments as JSON text
    openai_history = [*USER, {**first.message, "content": None}, history[2]]
    assert llm.prompt_ids(messages=openai_history) == llm.prompt_ids(messages=history)


def test_none_is_the_reply_without_tools_and_auto_text_or_calls(llm: quickdraft.LLM) -> None:
    short = SamplingParams(max_new_tokens=40)
    none = llm.generate(messages=USER, params=short, tools=TOOLS, tool_choice="none")
    assert none.token_ids == llm.generate(messages=USER, params=short).token_ids and none.tool_calls == []
    auto = llm.generate(messages=USER, params=PARAMS, tools=TOOLS)
    if auto.text.startswith("{"):  # the generic syntax: a reply beginning with "{" is calls
        assert auto.finish_reason == "tool_calls" and auto.tool_calls and auto.content == ""
    else:
        assert auto.tool_calls == [] and auto.content == auto.text


BAD = [  # (keyword arguments, the field named)
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "get weather"}}]), "tools.1.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}]), "tools.0.function.parameters"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}),
     "response_format"),
]


@pytest.mark.parametrize("kw,param", BAD)
def test_bad_tool_fields_are_refused_by_name(llm: quickdraft.LLM, kw: dict, param: str) -> None:
    with pytest.raises(ToolsError) as e:
        llm.generate(messages=USER, params=PARAMS, **kw)
    assert e.value.param == param and str(e.value).startswith(param.split(".")[0])
    with pytest.raises(ToolsError, match="give messages"):
        llm.generate("a prompt", tools=TOOLS)
    with pytest.raises(GrammarError):  # response_format alone still has its own errors
        llm.generate(messages=USER, response_format={"type": "json_schema", "json_schema": {"schema": 3}})


GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.slow
def test_smollm2_calls_through_the_python_api() -> None:
    """The packaged SmolLM2-135M-Instruct (generic syntax): a required call parses, its arguments
    validate against the function's schema, speculation gives the same call in fewer passes."""
    llm = quickdraft.load()
    kw = dict(messages=[{"role": "user", "content": "What is the weather in Paris right now?"}], tools=[GET_WEATHER],
              tool_choice="required", params=SamplingParams(max_new_tokens=120))
    plain = llm.generate(spec=SpecConfig(method="none"), **kw)
    assert plain.finish_reason == "tool_calls" and plain.tool_calls[0].name == "get_weather", plain.text
    for call in plain.tool_calls:
        jsonschema.validate(call.arguments, GET_WEATHER["function"]["parameters"])
    spec = llm.generate(spec=SpecConfig("ngram", k=8), **kw)
    assert [(c.name, c.arguments) for c in spec.tool_calls] == [(c.name, c.arguments) for c in plain.tool_calls]
    assert spec.stats.target_passes < plain.stats.target_passes
