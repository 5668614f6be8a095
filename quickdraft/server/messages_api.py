"""Anthropic's Messages API on its way in: the bodies of /v1/messages and /v1/messages/count_tokens
(pydantic), and the chat request each is (`chat_request`), which the chat route then checks and runs.

Every field Anthropic documents has an answer, as on the OpenAI routes: implemented, accepted with no
effect, or refused unless at its neutral value; unknown fields are refused. Blocks ignore keys that
clients echo back from earlier answers (citations) and cache_control. Knows the chat request's shape,
not the engine.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
)

from quickdraft.server.errors import BadRequest
from quickdraft.server.schemas import (
    IGNORED,
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    STRICT_TOOL,
    ChatCompletionRequest,
    ChatMessage,
    Count,
    FunctionName,
    Json,
    Name,
    NonNegative,
    Speculative,
    StopList,
    Text,
    only,
)

CACHED = "accepted and ignored: the prefix cache keeps every prompt without being asked (usage.cache_read_input_tokens)"
PREFILL = "prefill_not_supported"  # the code of a conversation that ends with the assistant's turn
# Blocks of one message (text parts, calls, results): within the chat message's bounds, and few enough
# that MAX_MESSAGES messages of them fit the body limit, as a schema's worst case should.
MAX_BLOCKS = 64


class CacheControl(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """An assistant's earlier call of a tool."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["tool_use"]
    id: Name
    name: FunctionName
    input: Json


class ThinkingBlock(BaseModel):
    """An earlier answer's thinking (a harmony model's reasoning), echoed back: a harmony template
    writes it before the call it goes on from (its signature ignored: this server signs none)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["thinking"]
    thinking: Text


class ToolResultBlock(BaseModel):
    """A call's result, which the next answer reads: its text as it is (a chat has no error flag)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: Name
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] = ""
    is_error: bool | None = Field(default=None, description=IGNORED)


def _union(noun: str, key: str, *models: type[BaseModel]) -> Any:
    """Models told apart by their `key` field's value; named in error paths by their class names,
    which validation_error leaves out as it does any union's members (messages.0.content.0.text, not
    messages.0.user.content.0.text.text)."""
    tags = {get_args(model.model_fields[key].annotation)[0]: model.__name__ for model in models}

    def tag(value: Any) -> str | None:
        found = value.get(key) if isinstance(value, dict) else None
        return tags.get(found) if isinstance(found, str) else None  # a list or an object is no tag (nor a 500)

    expected = ", ".join(repr(value) for value in tags)
    return Annotated[Union[tuple(Annotated[model, Tag(model.__name__)] for model in models)],
                     Discriminator(tag, custom_error_type="invalid_union_member",
                                   custom_error_message=f"expected {noun} whose {key} is one of {expected}")]


Texts = Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)]
UserBlock = _union("a block", "type", TextBlock, ToolResultBlock)
AssistantBlock = _union("a block", "type", TextBlock, ToolUseBlock, ThinkingBlock)


class UserMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["user"]
    content: Text | Annotated[list[UserBlock], Field(max_length=MAX_BLOCKS)]


class AssistantMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["assistant"]
    content: Text | Annotated[list[AssistantBlock], Field(max_length=MAX_BLOCKS)]


class SystemMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system"]
    content: Text | Texts


Message = _union("a message", "role", UserMessage, AssistantMessage, SystemMessage)


class CustomTool(BaseModel):
    """A tool the model may call: its input follows input_schema, exact under speculation (docs/tools.md).
    Anthropic's server tools (web search, code execution, ...) are refused by their type."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["custom"] | None = None
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    input_schema: Json
    strict: bool | None = Field(default=None, description=STRICT_TOOL)
    cache_control: CacheControl | None = Field(default=None, description=CACHED)


NAME_WITH_TOOL = {  # the published schema states the check of _named
    "if": {"properties": {"type": {"const": "tool"}}},
    "then": {"required": ["name"], "properties": {"name": {"type": "string"}}},
    "else": {"properties": {"name": {"type": "null"}}}}


class ToolChoice(BaseModel):
    """auto: text or calls; any: calls; tool: a call of `name`; none: text only."""
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=NAME_WITH_TOOL)
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = Field(default=None, validate_default=True)
    disable_parallel_tool_use: bool | None = Field(default=None, description="true: at most one call in a reply")

    @field_validator("name")
    @classmethod
    def _named(cls, name: str | None, info: ValidationInfo) -> str | None:
        if (name is None) == (info.data.get("type") == "tool"):
            raise ValueError("required with type tool, and only then")
        return name


class Thinking(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Annotated[str, only("disabled", "adaptive", why="extended thinking with a budget (enabled) is not "
                              "supported: adaptive (a harmony model such as gpt-oss thinks as it does, in thinking "
                              "blocks; others never think) or disabled (no thinking blocks)")]
    display: Literal["summarized", "omitted"] | None = Field(default=None, description=IGNORED)


class OutputFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: Json = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: OutputFormat | None = Field(default=None, description=(
        "the answer is JSON valid under the schema, exact under speculation (not with tools)"))
    effort: Literal["low", "medium", "high"] | None = Field(default=None, description=(
        "a harmony (gpt-oss) model's reasoning effort, as its template writes it (unset: medium); other models "
        "refuse it"))


class Metadata(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    user_id: Name | None = None


class _Conversation(BaseModel):
    """What /v1/messages/count_tokens takes, and /v1/messages too."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: Name
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Texts | None = Field(default=None, description="a system message before the messages")
    tools: Annotated[list[CustomTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = Field(default=None, description=CACHED)
    speed: Annotated[str | None, only(None, "standard", why="this server has one speed: leave it unset or "
                                      "standard")] = None
    user_profile_id: Name | None = Field(default=None, description=IGNORED)
    workspace_id: Name | None = Field(default=None, description=IGNORED)


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would run it."""


class MessagesRequest(_Conversation):
    """POST /v1/messages."""
    max_tokens: Count
    stop_sequences: StopList | None = None
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: NonNegative = Field(default=0, description="0: no cut")
    metadata: Metadata | None = Field(default=None, description=IGNORED)
    service_tier: Annotated[str | None, only(None, "auto", "standard_only", why="this server has one tier: leave "
                                             "it unset, auto or standard_only")] = None
    inference_geo: Annotated[str | None, only(None, why="not supported: the server runs where it runs")] = None
    container: Annotated[Json | Name | None, only(None, why="not supported: no code execution")] = None
    diagnostics: Annotated[Json | None, only(None, why="not supported")] = None
    speculative: Speculative | None = None


def chat_request(body: CountTokensRequest | MessagesRequest) -> ChatCompletionRequest:
    """The chat request `body` is (a MessagesRequest's sampling too). Valid by construction: every
    field this schema takes fits the chat request's, but for the count of messages, below."""
    if body.messages[-1].role == "assistant":
        raise BadRequest(400, "messages: the last message is the assistant's, which Anthropic's API continues "
                              "(prefill); quickdraft does not: end with the user's turn", "messages", PREFILL)
    fields: dict[str, Any] = {"model": body.model, **_tools(body)}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      speculative=body.speculative.model_dump(exclude_none=True) if body.speculative else None)
    # The conversation is bounded as Anthropic's messages and their blocks (MAX_MESSAGES, MAX_BLOCKS); as
    # chat messages (the system turn and each tool result one) it may pass the chat's count of messages,
    # so each is checked as a chat message and the request with the first, not the count
    messages = [ChatMessage.model_validate(message) for message in _messages(body)]
    chat = ChatCompletionRequest.model_validate({**fields, "messages": messages[:1]})
    return chat.model_copy(update={"messages": messages})


def _messages(body: CountTokensRequest | MessagesRequest) -> list[dict[str, Any]]:
    system = [] if body.system is None else [{"role": "system", "content": _text(body.system)}]
    return system + [turn for message in body.messages for turn in _turns(message)]


def _text(content: str | list[TextBlock]) -> str | list[dict[str, str]]:
    """Text as a chat message's content: a string, or text parts (the chat joins them as it does its own)."""
    return content if isinstance(content, str) else [{"type": "text", "text": block.text} for block in content]


def _turns(message: UserMessage | AssistantMessage | SystemMessage) -> list[dict[str, Any]]:
    """A message as chat messages: an assistant's tool_use blocks its tool_calls; each tool_result a tool
    message, before the user's text (Anthropic puts results first in their turn)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = _text([block for block in message.content if isinstance(block, TextBlock)])
    if isinstance(message, AssistantMessage):
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
        turn = {"role": "assistant", "content": text or None, "tool_calls": calls} if calls \
            else {"role": "assistant", "content": text}
        return [{**turn, "reasoning_content": thinking} if thinking else turn]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in message.content if isinstance(b, ToolResultBlock)]
    return results + ([{"role": message.role, "content": text}] if text or not results else [])


def _tools(body: CountTokensRequest | MessagesRequest) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls, response_format and reasoning_effort, as the chat
    request names them."""
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.input_schema, "strict": t.strict}}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                 else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    if body.output_config is not None and body.output_config.effort is not None:
        fields["reasoning_effort"] = body.output_config.effort
    return fields


PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format",
          "reasoning_effort": "output_config.effort", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def messages_param(param: str | None) -> str | None:
    """A chat request's field named as the Messages request names it. Chat messages are only
    `messages`: the system turn and the tool results, each a message, move them from their places."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "messages"
    if tool := re.fullmatch(r"tools\.(\d+)\.function\.(.+)", param):
        return f"tools.{tool[1]}.{'input_schema' if tool[2] == 'parameters' else tool[2]}"
    return PARAMS.get(param, param)
