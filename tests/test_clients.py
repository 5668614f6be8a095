"""The client libraries of the `clients` extra (issue 44's acceptance) against a live server on the
real SmolLM2-135M-Instruct: the openai client (Responses and chat tool loops), openai-agents and
pydantic-ai (a function tool and a structured output), langchain-openai, instructor (scripts/install.sh
installs it without its pins: its jiter pin conflicts with openai's), the anthropic SDK and lm-eval. Slow: `pytest -m slow`; a
library missing (`pip install -e .[clients]`) skips its tests.

Greedy throughout, so every answer is one text. Oracles: the Python API (`LLM.generate` with the same
messages, tools, tool_choice and response_format; `LLM.score` for lm-eval's loglikelihoods); pydantic
validation of every call's arguments and structured output against the model the library was given;
each client's stream accumulation against its whole answer; the raw reply a library parsed (its text or
its call) against what it returned.

The 135M calls a tool again whenever one is offered under `auto`, the tool's result before it or not
(measured: every turn of a 4-turn agent run is the same call), so the agents below offer their tool once.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator, Literal

import openai
import pytest
from pydantic import BaseModel, Field

import quickdraft
from quickdraft.api import Completion
from quickdraft.spec.sampling import SamplingParams
from support.server import NAME, Server

pytestmark = pytest.mark.slow


class GetWeather(BaseModel):
    """The weather in a city, now."""
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time in a city."""
    city: str = Field(max_length=20)


class Report(BaseModel):
    """A weather report."""
    city: str = Field(max_length=20)
    sunny: bool


FUNCTIONS = {"GetWeather": GetWeather, "GetTime": GetTime}
CHAT_TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS[:1]]  # name, parameters, strict
QUESTION = "What is the weather in Paris?"
BOTH = "What is the weather and the local time in Paris and in Rome?"
SUNNY = "Paris is sunny today. Report the weather in Paris."
RESULT = "18 C, sunny"


@pytest.fixture(scope="module")
def llm() -> quickdraft.LLM:
    return quickdraft.load()


@pytest.fixture(scope="module")
def server(llm: quickdraft.LLM) -> Iterator[Server]:
    s = Server(llm, max_batch=2)
    yield s
    s.stop()


def api(llm: quickdraft.LLM, max_tokens: int, stop: tuple[str, ...] = (), **kw: Any) -> Completion:
    """The Python API's greedy answer: the oracle for the server's."""
    return llm.generate(params=SamplingParams(max_new_tokens=max_tokens, stop=stop), **kw)


def assistant_with(calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """An OpenAI assistant turn of (id, name, arguments JSON) calls."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, name, arguments in calls]}


# -- the openai client ------------------------------------------------------------------------------------------

def test_openai_responses_tool_loop_created_and_streamed(server: Server, llm: quickdraft.LLM) -> None:
    """A forced call, its function_call_output on previous_response_id, then the text answer; each
    turn streamed too, and each the Python API's answer to the conversation it stands for."""
    kw = dict(model=NAME, tools=RESPONSES_TOOLS, temperature=0)
    first = server.client.responses.create(input=QUESTION, tool_choice="required", max_output_tokens=100, **kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and len(calls) == len(first.output), first.output
    assert all(c.name == "GetWeather" and GetWeather.model_validate_json(c.arguments) for c in calls)
    with server.client.responses.stream(input=QUESTION, tool_choice="required", max_output_tokens=100, **kw) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output] == [(c.name, c.arguments) for c in calls]
    assert "".join(pieces) == "".join(c.arguments for c in calls) and len(pieces) > len(calls)
    user = [{"role": "user", "content": QUESTION}]
    expected = api(llm, 100, messages=user, tools=CHAT_TOOLS[:1], tool_choice="required")
    assert expected.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, c.arguments) for c in expected.tool_calls]

    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT} for c in calls]
    later = dict(previous_response_id=first.id, input=outputs, tool_choice="none", max_output_tokens=40, **kw)
    answer = server.client.responses.create(**later)
    with server.client.responses.stream(**later) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    assert "".join(deltas) == final.output_text == answer.output_text and len(deltas) > 1
    history = [*user, assistant_with([(c.call_id, c.name, c.arguments) for c in calls]),
               *({"role": "tool", "tool_call_id": c.call_id, "content": RESULT} for c in calls)]
    assert answer.output_text == api(llm, 40, messages=history, tools=CHAT_TOOLS[:1], tool_choice="none").text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "GetTime"}}],
                         ids=["required", "named"])
def test_openai_chat_tool_loop_with_parallel_calls_allowed(server: Server, llm: quickdraft.LLM,
                                                           tool_choice: Any) -> None:
    """Two strict pydantic tools, parallel_tool_calls unset (OpenAI's default: allowed); the client's
    parse() validates each call's arguments into its tool's model; streamed calls are the same."""
    messages = [{"role": "user", "content": BOTH}]
    kw = dict(model=NAME, tools=CHAT_TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    reply = server.client.chat.completions.parse(messages=messages, **kw).choices[0]
    calls = reply.message.tool_calls
    assert reply.finish_reason == "tool_calls" and calls, reply
    allowed = {"GetTime"} if isinstance(tool_choice, dict) else set(FUNCTIONS)
    for call in calls:
        assert call.function.name in allowed
        assert isinstance(call.function.parsed_arguments, FUNCTIONS[call.function.name])
        assert FUNCTIONS[call.function.name].model_validate_json(call.function.arguments)
    with server.client.chat.completions.stream(messages=messages, **kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [c.function for c in streamed.message.tool_calls] == [c.function for c in calls]
    expected = api(llm, 200, messages=messages, tools=CHAT_TOOLS, tool_choice=tool_choice)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.name, c.arguments) for c in expected.tool_calls]

    history = [*messages, assistant_with([(c.id, c.function.name, c.function.arguments) for c in calls]),
               *({"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in calls)]
    answer = server.client.chat.completions.create(model=NAME, messages=history, tools=CHAT_TOOLS, tool_choice="none",
                                                   max_tokens=40, temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    oracle = api(llm, 40, messages=history, tools=CHAT_TOOLS, tool_choice="none")
    assert answer.message.content == oracle.text and answer.finish_reason == oracle.finish_reason


# -- openai-agents ---------------------------------------------------------------------------------------------

def test_openai_agents_tool_then_output_type_on_both_models(server: Server) -> None:
    """An Agent with a function tool and output_type=Report, on OpenAIResponsesModel and on
    OpenAIChatCompletionsModel: tool_choice "required" forces the first turn's call (the agent runs
    the tool, then resets tool_choice), the second turn answers Report's JSON under its schema."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not cities)  # offered until called once (the docstring above)
    def get_weather(city: str) -> str:
        """The weather in a city, now."""
        cities.append(city)
        return RESULT

    async def run(kind: type) -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=kind(NAME, client),
                      output_type=Report,
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=100))
        return await Runner.run(agent, QUESTION, max_turns=4)

    finals, arguments = [], []
    for kind in (OpenAIResponsesModel, OpenAIChatCompletionsModel):
        cities.clear()
        result = asyncio.run(run(kind))
        called, answered = result.raw_responses
        assert [(item.type, item.name) for item in called.output] == [("function_call", "get_weather")], kind
        call = called.output[0]
        assert cities == [json.loads(call.arguments)["city"]]
        [message] = answered.output
        assert message.type == "message" and isinstance(result.final_output, Report)
        assert Report.model_validate_json(message.content[0].text) == result.final_output
        finals.append(result.final_output)
        arguments.append(call.arguments)
    assert finals[0] == finals[1] and arguments[0] == arguments[1]  # the same conversation through either route


# -- pydantic-ai -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("native", [True, False], ids=["NativeOutput", "tool-output"])
def test_pydantic_ai_agent_with_a_tool_and_an_output_type(server: Server, native: bool) -> None:
    """pydantic-ai's OpenAIChatModel on the server: the first step's tool_choice "required" (a per-step
    setting) calls get_weather; then NativeOutput(Report) is answered as JSON text under Report's
    schema (response_format), the default output as a call of its final_result tool."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput, RunContext
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(NAME, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))

    def settings(ctx: RunContext) -> dict[str, Any]:
        return {"temperature": 0, "max_tokens": 100, **({"tool_choice": "required"} if ctx.run_step == 1 else {})}

    agent = Agent(model, output_type=NativeOutput(Report) if native else Report, instructions="Answer briefly.",
                  model_settings=settings)
    cities: list[str] = []

    async def once(ctx: RunContext, definition: Any) -> Any:  # offered until called once (the docstring above)
        return None if cities else definition

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """The weather in a city, now."""
        cities.append(city)
        return RESULT

    result = agent.run_sync(QUESTION)
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert isinstance(result.output, Report)
    [call] = responses[0].parts
    assert isinstance(call, ToolCallPart) and call.tool_name == "get_weather"
    assert cities == [call.args_as_dict()["city"]]
    [last] = responses[-1].parts
    if native:
        assert len(responses) == 2 and isinstance(last, TextPart)
        assert Report.model_validate_json(last.content) == result.output
    else:
        assert isinstance(last, ToolCallPart) and last.tool_name == "final_result"
        assert Report.model_validate(last.args_as_dict()) == result.output


# -- langchain-openai ------------------------------------------------------------------------------------------

def chat_openai(server: Server) -> Any:
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI
    return ChatOpenAI(model=NAME, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=100,
                      max_retries=0)


def test_langchain_bind_tools_forced_call(server: Server, llm: quickdraft.LLM) -> None:
    bound = chat_openai(server).bind_tools([GetWeather, GetTime], tool_choice="GetWeather")
    message = bound.invoke(QUESTION)
    assert message.response_metadata["finish_reason"] == "tool_calls" and message.tool_calls, message
    assert all(c["name"] == "GetWeather" and GetWeather.model_validate(c["args"]) for c in message.tool_calls)
    expected = api(llm, 100, messages=[{"role": "user", "content": QUESTION}], tools=bound.kwargs["tools"],
                   tool_choice=bound.kwargs["tool_choice"])  # the tools as langchain sent them
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [(c.name, c.arguments) for c in expected.tool_calls]
    chunks = list(bound.stream(QUESTION))
    streamed = sum(chunks[1:], chunks[0])  # langchain's own accumulation of the streamed deltas
    assert len(chunks) > 2 and streamed.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"],
                         ids=["default", "json_schema", "function_calling"])
def test_langchain_structured_output(server: Server, llm: quickdraft.LLM, method: str | None) -> None:
    """ChatOpenAI's default method (json_schema: response_format) and function_calling (a forced call)."""
    structured = chat_openai(server).with_structured_output(Report, include_raw=True,
                                                            **({"method": method} if method else {}))
    out = structured.invoke(SUNNY)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Report), out
    raw = out["raw"]
    if method == "function_calling":
        assert [(c["name"], Report.model_validate(c["args"])) for c in raw.tool_calls] == [("Report", out["parsed"])]
        return
    assert raw.tool_calls == [] and Report.model_validate_json(raw.content) == out["parsed"]
    schema = {"type": "json_schema", "json_schema": {"name": "Report", "schema": Report.model_json_schema()}}
    assert raw.content == api(llm, 100, messages=[{"role": "user", "content": SUNNY}], response_format=schema).text


# -- instructor ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes_return_the_model(server: Server, mode: str) -> None:
    """instructor 1.17 pins jiter<0.15, openai 3.52 needs jiter>=0.16: not in the clients extra, which
    pip resolves; scripts/install.sh installs it without its pins, and it runs on openai's jiter."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    report, raw = client.chat.completions.create_with_completion(
        model=NAME, response_model=Report, max_retries=0, temperature=0, max_tokens=100,
        messages=[{"role": "user", "content": SUNNY}])
    assert isinstance(report, Report)  # instructor's subclass of it: compared by fields below
    choice = raw.choices[0]
    if mode == "TOOLS":
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("Report", report.model_dump())]
    else:
        assert choice.finish_reason == "stop" and json.loads(choice.message.content) == report.model_dump()


# -- the anthropic SDK -----------------------------------------------------------------------------------------

GREEDY = {"temperature": 0}  # not a keyword of this SDK's create(): sent as an extra field of the body
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city, now.",
                    "input_schema": GetWeather.model_json_schema()}]
AS_OPENAI = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in ANTHROPIC_TOOLS]


@pytest.fixture(scope="module")
def claude(server: Server) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_anthropic_create_and_stream_are_one_text(claude: Any, llm: quickdraft.LLM) -> None:
    kw = dict(model=NAME, max_tokens=40, system="Be brief.", extra_body=GREEDY,
              messages=[{"role": "user", "content": "Name three colours."}])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        pieces = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert "".join(pieces) == whole.content[0].text == final.content[0].text and len(pieces) > 1
    oracle = api(llm, 40, messages=[{"role": "system", "content": "Be brief."}, *kw["messages"]])
    assert whole.content[0].text == oracle.text
    assert whole.stop_reason == final.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[oracle.finish_reason]
    assert whole.usage.output_tokens == final.usage.output_tokens == len(oracle.token_ids)


def test_anthropic_tool_loop(claude: Any, llm: quickdraft.LLM) -> None:
    """tool_use forced by {"type": "tool"}, its input under the schema; the tool_result; the answer."""
    user = [{"role": "user", "content": QUESTION}]
    kw = dict(model=NAME, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    m = claude.messages.create(messages=user, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=100, **kw)
    assert m.stop_reason == "tool_use" and [(b.type, b.name) for b in m.content] == [("tool_use", "get_weather")], m
    call = m.content[0]
    GetWeather.model_validate(call.input)
    expected = api(llm, 100, messages=user, tools=AS_OPENAI, tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}})
    assert [(c.name, c.arguments) for c in expected.tool_calls] == [(call.name, call.input)]
    history = [*user, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}]
    answer = claude.messages.create(messages=history, tool_choice={"type": "none"}, max_tokens=40, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    oracle = api(llm, 40, messages=[*user, assistant_with([("c1", call.name, json.dumps(call.input))]),
                                    {"role": "tool", "tool_call_id": "c1", "content": RESULT}],
                 tools=AS_OPENAI, tool_choice="none")
    assert answer.content[0].text == oracle.text and answer.content[0].text


# -- lm-eval ---------------------------------------------------------------------------------------------------

DOCS = [{"question": "What colour is the sky?", "choices": ["blue", "green", "a red brick"], "answer": 0},
        {"question": "What is 2 + 2?", "choices": ["4", "five"], "answer": 0},
        {"question": "Which animal barks?", "choices": ["a cat", "the dog"], "answer": 1}]
TASK = """task: {name}
output_type: {output_type}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
"""
CHOICE = TASK + """doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
UNTIL = TASK + """doc_to_target: " {{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
GEN_TOKENS, GEN_STOP = 16, ("\n",)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory, llm: quickdraft.LLM) -> Path:
    """The two tasks' YAML over a local JSONL (no hub), and the model's own tokenizer as an HF directory."""
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "choice.yaml").write_text(CHOICE.format(name="qd_choice", output_type="multiple_choice", data=data))
    (root / "until.yaml").write_text(UNTIL.format(name="qd_until", output_type="generate_until", data=data))
    llm.tokenizer.hf.save_pretrained(root / "tokenizer")
    return root


def evaluate(tasks: Path, names: list[str], monkeypatch: pytest.MonkeyPatch, **kw: Any) -> dict[str, list[dict]]:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(tasks=names, log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks), include_defaults=False), **kw)
    return results["samples"]


def test_lm_eval_local_completions_scores_and_generates(server: Server, llm: quickdraft.LLM, tasks: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """loglikelihood (batched token-id prompts, echo, max_tokens 1) equals LLM.score's sums over each
    continuation's tokens, tokenized by the model's own tokenizer; generate_until equals LLM.generate."""
    from transformers import AutoTokenizer
    saved = AutoTokenizer.from_pretrained(str(tasks / "tokenizer"))
    probe = "Q: What colour is the sky?\nA: a red brick <|im_end|> é"
    assert saved.encode(probe) == llm.tokenizer.encode(probe)  # the premise: lm-eval tokenizes as the model does
    samples = evaluate(tasks, ["qd_choice", "qd_until"], monkeypatch, model="local-completions",
                       model_args={"model": NAME, "base_url": f"{server.url}/v1/completions",
                                   "tokenizer": str(tasks / "tokenizer"), "tokenizer_backend": "huggingface",
                                   "batch_size": 2, "max_length": 2048})
    assert len(samples["qd_choice"]) == len(DOCS)
    scored = []
    for sample in samples["qd_choice"]:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"], strict=True):
            context_ids = llm.tokenizer.encode(context, add_special_tokens=False)
            ids = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
            tail = llm.score(ids, top_logprobs=1).logprobs[len(context_ids) - 1:]  # the continuation's tokens
            assert ll == pytest.approx(sum(x.logprob for x in tail), abs=1e-4)
            assert greedy == all(x.logprob == x.top[0][1] for x in tail)
            scored.append(ll)
    assert len(scored) == sum(len(d["choices"]) for d in DOCS) and len(set(scored)) == len(scored)
    assert [s["resps"][0][0] for s in samples["qd_until"]] == [
        api(llm, GEN_TOKENS, prompt=s["arguments"][0][0], stop=GEN_STOP).text for s in samples["qd_until"]]


def test_lm_eval_local_chat_completions_generates(server: Server, llm: quickdraft.LLM, tasks: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    samples = evaluate(tasks, ["qd_until"], monkeypatch, model="local-chat-completions", apply_chat_template=True,
                       model_args={"model": NAME, "base_url": f"{server.url}/v1/chat/completions",
                                   "tokenizer_backend": "none", "tokenized_requests": False, "batch_size": 1})
    samples = samples["qd_until"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        messages = json.loads(sample["arguments"][0][0][0])
        assert [m["role"] for m in messages] == ["user"]
        answer = sample["resps"][0][0]
        assert answer and answer == api(llm, GEN_TOKENS, messages=messages, stop=GEN_STOP).text
