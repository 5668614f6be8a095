"""OpenAI's Responses API on its way in: the request body (pydantic), and the chat request it is.

/v1/responses is an adapter over /v1/chat/completions: a request's input items (messages, earlier
function calls and their outputs), instructions, tools, tool_choice and text.format become a chat
request's messages, tools, tool_choice and response_format, which the chat route checks and runs.
Items are kept as plain dicts (as validated here), so a stored response's items continue a
conversation (previous_response_id) as they came. Knows the chat request's shape, not the engine.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag, ValidationError

from quickdraft.server.errors import BadRequest, validation_error
from quickdraft.server.schemas import (
    IGNORED,
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGES,
    MAX_METADATA,
    MAX_TOOLS,
    STRICT_TOOL,
    ChatCompletionRequest,
    Count,
    FunctionName,
    Json,
    JsonSchemaFormat,
    Name,
    NonNegative,
    Seed,
    Speculative,
    Text,
    only,
)

Item = dict[str, Any]  # an input or output item, as validated (model_dump) or as responses_answer.py writes it


class ContentPart(BaseModel):
    """A message's text: input_text, or output_text echoed from an earlier answer (its annotations and
    logprobs ignored). Other parts (images, files) are a 400."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["input_text", "output_text"]
    text: Text


Content = Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class MessageItem(BaseModel):
    """A message (an earlier answer's item echoed back keeps its id and status, ignored)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(BaseModel):
    """A call the model made earlier, as its answer's output item had it."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function_call"]
    call_id: Name
    name: FunctionName
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    """A call's result, which the next answer reads."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function_call_output"]
    call_id: Name
    output: Content


class ReasoningText(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning (a harmony model's), echoed back: its text goes with the assistant
    message after it, which a harmony template writes before a call it goes on from (its id, summary
    and status ignored)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: Annotated[str | None, only(None, why="not supported: this server encrypts no reasoning; "
                                                  "echo back the item's content")] = None


def _item_type(item: Any) -> str | None:
    """An item's type; one without is a message (OpenAI's "easy" input message)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] |
                      Annotated[FunctionCallOutputItem, Tag("function_call_output")] |
                      Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(_item_type, custom_error_type="invalid_union_member",
                                    custom_error_message="expected an input item: a message, or an object whose type is "
                                                         "one of 'message', 'function_call', 'function_call_output', "
                                                         "'reasoning'")]


class FunctionTool(BaseModel):
    """A function the model may call, in the Responses API's flat shape."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: Json | None = Field(default=None, description="the arguments' JSON schema (unset: no arguments)")
    strict: bool | None = Field(default=None, description=STRICT_TOOL)


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    name: FunctionName


class JsonSchemaText(JsonSchemaFormat):
    """text.format json_schema: chat's response_format.json_schema, flat, with its type."""
    type: Literal["json_schema"]


class PlainText(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object"]


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: Annotated[JsonSchemaText | PlainText, Field(discriminator="type")] | None = Field(
        default=None, description="json_object or json_schema: the output is JSON (under the schema), exact under "
                                  "speculation")
    verbosity: Annotated[str | None, only(None, why="not supported")] = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    effort: Literal["low", "medium", "high"] | None = Field(default=None, description=(
        "a harmony (gpt-oss) model's reasoning effort, as its template writes it (unset: medium); other models "
        "refuse it"))
    summary: Annotated[str | None, only(None, "auto", why="no summaries: a harmony model's reasoning comes whole, "
                                        "as its reasoning item's content")] = None
    generate_summary: Annotated[str | None, only(None, "auto", why="no summaries (summary's older name)")] = None


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_obfuscation: bool | None = Field(default=None, description="accepted, no effect: no event is padded")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Fields OpenAI defines and quickdraft does not implement pass only at their
    neutral value; unknown fields are refused (docs/server.md)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: Name
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = Field(default=None, description="a system message before the input (not carried "
                                      "over from previous_response_id)")
    previous_response_id: Name | None = Field(default=None, description=(
        "continue a stored response: its input and output come before this input"))
    store: bool = Field(default=True, description="keep the response for GET and previous_response_id (in memory, "
                        "least recently used dropped first)")
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Seed | None = Field(default=None, description="quickdraft's: the sampler's seed")
    speculative: Speculative | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = Field(default=None, description=(
        "functions the model may call; their calls follow their parameters' schemas, exact under speculation"))
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call in a reply")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = Field(default=None, description=(
        "effort: a harmony (gpt-oss) model's; its reasoning comes as a reasoning item before the message"))
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = Field(default=None, description="kept and echoed")
    user: Name | None = Field(default=None, description=IGNORED)
    prompt_cache_key: Name | None = Field(default=None, description=(
        "only requests with the same key (and API key) share prefix-cache entries"))
    safety_identifier: Name | None = Field(default=None, description=IGNORED)
    include: Annotated[list[str] | None, only(None, [], why="not supported: no extra output fields")] = None
    truncation: Annotated[str | None, only(None, "disabled", why="only disabled: a prompt past the context is "
                                                                   "a 400")] = None
    service_tier: Annotated[str | None, only(None, "auto", "default", why="this server has one tier: "
                                             "leave it unset, auto or default")] = None
    background: Annotated[bool | None, only(None, False, why="not supported: responses run in the foreground")
                          ] = None
    max_tool_calls: Annotated[Count | None, only(None, why="not supported")] = None
    top_logprobs: Annotated[NonNegative | None, only(None, 0, why="not supported on /v1/responses")] = None
    conversation: Annotated[Name | Json | None, only(None, why="not supported: continue with "
                                                     "previous_response_id")] = None
    prompt: Annotated[Json | None, only(None, why="not supported: no stored prompts")] = None

    def items(self) -> list[Item]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True) for item in self.input]


def chat_request(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    """The chat request that answers `body`, its conversation being `items` (a stored response's
    items and output, then this request's); a 400 where the chat request cannot hold them."""
    choice = body.tool_choice
    fields = {
        "model": body.model, "messages": messages(body.instructions, items), "stream": body.stream,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "max_completion_tokens": body.max_output_tokens, "metadata": body.metadata,
        "speculative": body.speculative.model_dump(exclude_none=True) if body.speculative is not None else None,
        "tools": [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                  for tool in body.tools] if body.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionToolChoice) else choice,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body.text),
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # e.g. more messages than a chat holds, with a stored conversation's
        message, param = validation_error([{**error, "loc": ("body", *error["loc"])} for error in e.errors()])
        raise renamed(BadRequest(400, message, param)) from None


def messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """A conversation's items as chat messages: consecutive calls one assistant message's tool_calls
    (after its text, where the model wrote some), a call's output a tool message, a reasoning item's
    text the reasoning_content of the assistant message right after it (a call after it begins one)."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning = ""  # a reasoning item's, for the assistant message that follows it
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += "".join(part["text"] for part in item.get("content") or ())
            continue
        if kind == "message":
            chat.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if chat and chat[-1]["role"] == "assistant" and not reasoning:
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            chat.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        if reasoning and chat[-1]["role"] == "assistant":  # another item after it: the reasoning is not its
            chat[-1]["reasoning_content"] = reasoning
        reasoning = ""
    return chat


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (None: free text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(fmt, PlainText):
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})}


# the chat request's fields, as this request names them: the chat route's 400s name these
PARAMS = [(re.compile(r"^messages.*"), "input"),
          (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
          (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
          (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
          (re.compile(r"^tools\.(\d+)\.function"), r"tools.\1")]


def renamed(e: BadRequest) -> BadRequest:
    """A chat request's 400, naming the field (its param, and its message's opening) as this request does."""
    param = responses_param(e.param)
    message = f"{param}{e.message[len(e.param):]}" if e.param and e.message.startswith(f"{e.param}:") else e.message
    return BadRequest(e.status, message, param, e.code)


def responses_param(param: str | None) -> str | None:
    """A chat request's field (a 400's param) as the Responses request names it."""
    for pattern, name in PARAMS:
        if param is not None and pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param
