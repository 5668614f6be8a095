"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (a string where a number belongs is a 400, not a coercion); fields OpenAI defines
but quickdraft does not implement are refused when set to anything but their neutral value, so a
client never silently gets something other than what it asked for. Unknown fields are ignored.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, field_validator

from quickdraft.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from quickdraft.tokenizer import unicode_error


def _unicode(text: str) -> str:
    if (error := unicode_error(text)) is not None:
        raise ValueError(error)
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # text that reaches the tokenizer
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
# One string or a list of them; validated as a list so an error names the string it is about.
Stop = Annotated[StopList, BeforeValidator(lambda v: [v] if isinstance(v, str) else v,
                                           json_schema_input_type=StopString | StopList)]


def only(*allowed: object, why: str) -> AfterValidator:
    """A field OpenAI defines and quickdraft does not implement: only its neutral values pass, so
    the error names the field (a model-level check would give param null)."""
    def check(value: object) -> object:
        if value not in allowed:
            raise ValueError(why)
        return value
    return AfterValidator(check)


ModelName = Annotated[str, StringConstraints(max_length=256)]


class Speculative(BaseModel):
    """quickdraft's extra field: this request's speculation; unset parts take the server's flags."""
    model_config = ConfigDict(strict=True, extra="forbid")
    method: Annotated[str, StringConstraints(max_length=64)] | None = None  # a proposer, or "none"
    k: int | None = None
    adaptive: bool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: ModelName
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)   # not OpenAI's, but common in compatible servers
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Stop | None = None
    stream: bool = False
    n: Annotated[int, only(1, why="must be 1 (quickdraft returns one choice per request)")] = 1
    speculative: Speculative | None = None
    # OpenAI fields quickdraft does not implement: allowed only at their neutral values.
    presence_penalty: Annotated[float | None, only(None, 0, why="not supported; leave it unset or 0")] = None
    frequency_penalty: Annotated[float | None, only(None, 0, why="not supported; leave it unset or 0")] = None
    logit_bias: Annotated[dict[str, float] | None, only(None, {}, why="not supported; leave it unset or {}")] = None
    logprobs: Annotated[bool | int | None, only(None, False, 0, why="not supported; leave it unset, false or 0")] = None
    best_of: Annotated[int | None, only(None, 1, why="must be 1")] = None
    echo: Annotated[bool | None, only(None, False, why="not supported; leave it unset or false")] = None


class CompletionRequest(_Common):
    prompt: Text | list[int] | list[Text]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("give one prompt per request (a string or token ids)")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must not be empty")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def chat(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]
