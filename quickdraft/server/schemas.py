"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (a string where a number belongs is a 400, not a coercion). Every field OpenAI
defines has an explicit answer: implemented, accepted with no effect (identifiers and metadata,
listed in docs/server.md), or refused when set to anything but its neutral value, so a client
never silently gets something other than what it asked for. Unknown fields are refused.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from quickdraft.model.tokenizer import unicode_error
from quickdraft.proposers import MAX_K
from quickdraft.proposers.registry import option_fields
from quickdraft.spec.sampling import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
)


def _integral(value: object) -> object:
    return int(value) if type(value) is float and value.is_integer() else value


# JSON Schema's "integer" holds 1.0 too (a number with no fraction), so the server does as well;
# "1" and true stay refused.
Int = Annotated[int, BeforeValidator(_integral)]
# bounds sit before the validator, where the published schema shows them as minimum / maximum
Count = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
NonNegative = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=0, lt=2**63), BeforeValidator(_integral)]  # 2**63: exact as a float (openapi.py)
DraftLength = Annotated[int, Field(ge=0, le=MAX_K), BeforeValidator(_integral)]
MAX_CHOICES = 16  # n: each choice is a request of its own in the batch and in the server's limits
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)]
Penalty = Annotated[float, Field(ge=-PENALTY_RANGE, le=PENALTY_RANGE)]


def _unicode(text: str) -> str:
    if (error := unicode_error(text)) is not None:
        raise ValueError(error)
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # text that reaches the tokenizer
PromptText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_unicode)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
# One string or a list of them; validated as a list so an error names the string it is about.
Stop = Annotated[StopList, BeforeValidator(lambda v: [v] if isinstance(v, str) else v,
                                           json_schema_input_type=StopString | StopList)]


@dataclass(frozen=True)
class only:
    """A field OpenAI defines and quickdraft does not implement: only its neutral values pass, and the
    published schema says so (an enum). A field validator, so the error names the field."""
    allowed: tuple[object, ...]
    why: str

    def __init__(self, *allowed: object, why: str) -> None:
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "why", why)

    def _check(self, value: object) -> object:
        if value not in self.allowed:
            raise ValueError(self.why)
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"enum": list(self.allowed), "description": self.why}


# Every list and string has a bound, published in /openapi.json. Text that reaches the tokenizer
# (prompts, message contents, tool call arguments) is bounded by the body limit (--max-body-bytes,
# which openapi.py writes in) and then by the context, from its length alone (prompts.py).
MAX_NAME_CHARS = 256      # model, names, ids, the user field
MAX_MESSAGES = 2048       # OpenAI's own limit
MAX_CONTENT_PARTS = 256   # text parts of one message
MAX_TOOL_CALLS = 128      # earlier tool calls of one assistant message
MAX_DESCRIPTION_CHARS = 4096  # a json_schema's description (it changes nothing generated)
MAX_METADATA = 16         # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
ModelName = Name


class _SpeculativeBase(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    method: Annotated[str, StringConstraints(max_length=64)] | None = None  # a proposer, or "none"
    k: DraftLength | None = None
    adaptive: bool | None = None


# quickdraft's extra field: this request's speculation; unset parts take the server's flags. The
# proposers' own options (ngram_max, ...) are fields too, named and described as the registry has
# them (their defaults live there; the chosen proposer's options dataclass checks the values).
def _option_type(f: dataclasses.Field) -> Any:
    """A proposer option's request type: its default's, bounded by its range; a whole-number
    option takes 3.0 as the schema's "integer" does (Int), and type() is exact: bools stay bools.
    The bounds sit inside the Annotated, where the schema shows them as minimum / maximum."""
    lo, hi = f.metadata.get("range", (None, None))
    kind = type(f.default)
    if kind is int:
        return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_integral)] | None
    return Annotated[kind, Field(ge=lo, le=hi)] | None


Speculative = create_model(
    "Speculative", __base__=_SpeculativeBase,
    __doc__="quickdraft's extra field: this request's speculation; unset parts take the server's flags.",
    **{name: (_option_type(f), Field(default=None, description=f.metadata.get("help")))
       for name, f in option_fields().items()})
SPEC_FIELDS = frozenset(_SpeculativeBase.model_fields)  # SpecConfig's own; the rest are proposer options


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None       # a last chunk with empty choices and the usage, as OpenAI sends
    include_obfuscation: bool | None = None  # accepted, no effect: quickdraft pads no chunks


MAX_SCHEMA_KEYS = 64  # a JSON schema's top-level keywords (type, properties, $defs, ...): a few in practice
Json = Annotated[dict[str, Any], Field(max_length=MAX_SCHEMA_KEYS)]
IGNORED = "accepted and ignored"  # identifiers and metadata: they change nothing generated


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the output is JSON valid under `schema` (grammar.py)."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    schema_: Json = Field(default_factory=dict, alias="schema")  # {} (unset): any JSON value
    strict: bool | None = Field(default=None, description="true or unset: keywords the grammar library does not "
                                "implement are a 400; false: they pass unchecked")


JSON_SCHEMA_WITH_ITS_TYPE = {  # the published schema states the check of _with_type
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
    "else": {"properties": {"json_schema": {"type": "null"}}}}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=JSON_SCHEMA_WITH_ITS_TYPE)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _with_type(cls, spec: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if (spec is None) == (info.data.get("type") == "json_schema"):
            raise ValueError("required with type json_schema, and only then")
        return spec

    def constrains(self) -> dict[str, Any] | None:
        """The format as grammar.grammar_text takes it; None for text (no grammar)."""
        return None if self.type == "text" else self.model_dump(by_alias=True, exclude_none=True)


STREAM_OPTIONS_NEED_STREAM = {  # the published schema states the check of _streams_only
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=STREAM_OPTIONS_NEED_STREAM)
    model: ModelName
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: NonNegative = 0   # not OpenAI's, but common in compatible servers
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description=(  # vLLM's and llama.cpp's
        "tokens less likely than min_p times the likeliest one are cut (0 = off)"))
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices = Field(default=1, description="choices generated (each a request of its own, sharing the "
                       "prompt's prefill; seeded ones are seeded seed, seed + 1, ...)")
    speculative: Speculative | None = None
    response_format: ResponseFormat | None = Field(default=None, description=(
        "json_object or json_schema: the output is JSON (under the schema), exact under speculation"))
    user: Name | None = Field(default=None, description=IGNORED)
    cache_salt: Name | None = Field(default=None, description=(
        "vLLM's: only requests with the same salt (and API key) share prefix-cache entries"))
    presence_penalty: Penalty | None = Field(default=None, description=(
        "subtracted from the logit of each token generated so far, drafted ones on the verified path included"))
    frequency_penalty: Penalty | None = Field(default=None, description=(
        "subtracted from each token's logit once per time it was generated so far"))
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,8})$")],
                               Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(default=None, description=(
        "token id (a string) -> a bias added to its logit, in the target's and the proposer's distributions"))

    @field_validator("stream_options")
    @classmethod
    def _streams_only(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_PROMPTS = 128  # prompts of one completions request; each of their choices also takes a place in the server
TokenIds = Annotated[list[Int], Field(min_length=1)]


class CompletionRequest(_Common):
    max_tokens: NonNegative | None = Field(default=None, description=(
        "new tokens at most (default 16); 0: none, the prompt is only scored (echo with logprobs)"))
    logprobs: TopLogprobs | None = Field(default=None, description=(
        "each token's log-probability and this many likeliest alternatives' (the model's raw distribution)"))
    # one prompt (a string or token ids) or a batch of them, each with its n choices (index: prompt * n + choice)
    prompt: PromptText | TokenIds | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    best_of: Annotated[Int | None, only(None, 1, why="must be 1")] = None
    echo: bool | None = Field(default=None, description=(
        "each choice's text starts with the prompt's, and with logprobs its tokens' come first (the first's null)"))
    suffix: Annotated[str | None, only(None, "", why="not supported (no fill-in-the-middle); leave it unset")] = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt, or each of the batch."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ToolCall(BaseModel):
    """An assistant's earlier tool call, as history (OpenAI's shape)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    id: Name
    type: Literal["function"]
    function: "ToolCallFunction"


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[Name, AfterValidator(_unicode)]
    arguments: Text


CONTENT_UNLESS_TOOL_CALLS = {  # the published schema states the check of _needs_content
    "if": {"required": ["role", "tool_calls"],
           "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
    "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}}


class ChatMessage(BaseModel):
    """Keys OpenAI's clients echo back from earlier replies (refusal, annotations, audio) are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=CONTENT_UNLESS_TOOL_CALLS)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    name: Annotated[Name, AfterValidator(_unicode)] | None = None
    # history: the calls an assistant made, and which call a tool message answers
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Name | None = None
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        default=None, validate_default=True)
    reasoning_content: Text | None = Field(default=None, description=(
        "an assistant's reasoning, as replies carry it: a harmony (gpt-oss) template writes it before the call it "
        "goes on from"))

    @field_validator("content")
    @classmethod
    def _needs_content(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if info.data.get("role") == "assistant" and "tool_calls" not in info.data:
            return content  # its tool_calls failed: their error says what is wrong, not a missing content
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("required (only an assistant message with tool_calls may leave it out)")
        return content

    def to_template(self) -> dict[str, Any]:
        """The message with OpenAI's keys, as the Python API takes it (conversation.template_message writes
        it for the chat template)."""
        return self.model_dump(exclude_none=True, exclude={"tool_calls"} if not self.tool_calls else set())


TOP_LOGPROBS_NEED_LOGPROBS = {  # the published schema states the check of _with_logprobs
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


MAX_TOOLS = 128  # OpenAI's limit
FunctionName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


# a function's strict, here and in /v1/responses' and /v1/messages' tools (tools.py: strict unless false)
STRICT_TOOL = ("unset or true: schema keywords the grammar library does not implement are a 400; false: they "
               "pass unchecked")


class FunctionDefinition(BaseModel):
    """A function the model may call (docs/tools.md): its arguments are JSON under `parameters`."""
    model_config = ConfigDict(strict=True, extra="forbid")
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: Json | None = Field(default=None, description="the arguments' JSON schema (unset: no arguments)")
    strict: bool | None = Field(default=None, description=STRICT_TOOL)


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """tool_choice naming one of the tools: the reply calls it."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionChoice


NO_FUNCTIONS = "not supported: OpenAI's deprecated form of tools and tool_choice; use those"


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS]})
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool | None = Field(default=None, description=(
        "each token's log-probability (the model's raw distribution), and top_logprobs alternatives'"))
    top_logprobs: TopLogprobs | None = Field(default=None, validate_default=True,
                                             description="needs logprobs: true where above 0")
    max_completion_tokens: Count | None = None
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = Field(default=None, description=IGNORED)
    prompt_cache_key: Name | None = Field(default=None, description=(
        "only requests with the same key (and API key) share prefix-cache entries"))
    safety_identifier: Name | None = Field(default=None, description=IGNORED)
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call in a reply")
    service_tier: Annotated[str | None, only(None, "auto", "default", why="this server has one tier: "
                                             "leave it unset, auto or default")] = None
    store: Annotated[bool | None, only(None, False, why="quickdraft stores nothing; leave it unset or false")] = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(default=None, description=(
        "functions the model may call; their calls follow their parameters' schemas, exact under speculation"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(default=None, description=(
        "none: text only; auto (the default with tools): text or calls; required: calls; a function: a call of it"))
    functions: Annotated[list[Json] | None, only(None, [], why=NO_FUNCTIONS)] = None
    function_call: Annotated[str | Json | None, only(None, "none", "auto", why=NO_FUNCTIONS)] = None
    modalities: Annotated[list[str] | None, only(None, ["text"], why="only [\"text\"]")] = None
    audio: Annotated[Json | None, only(None, why="not supported: quickdraft generates text only")] = None
    prediction: Annotated[Json | None, only(None, why="not supported (predicted outputs)")] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(default=None, description=(
        "a harmony (gpt-oss) model's reasoning effort, as its template writes it (unset: medium); other models "
        "refuse it"))
    verbosity: Annotated[str | None, only(None, why="not supported")] = None
    web_search_options: Annotated[Json | None, only(None, why="not supported: quickdraft has no web search")] = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    def chat(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]
