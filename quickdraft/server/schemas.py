"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Types are strict (a string where a number belongs is a 400, not a coercion); fields OpenAI defines
but quickdraft does not implement are refused when set to anything but their neutral value, so a
client never silently gets something other than what it asked for. Unknown fields are ignored.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

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


class Speculative(BaseModel):
    """quickdraft's extra field: this request's speculation; unset parts take the server's flags."""
    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = None   # a proposer name, or "none" for plain decoding
    k: int | None = None
    adaptive: bool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)   # not OpenAI's, but common in compatible servers
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Stop | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1)
    speculative: Speculative | None = None
    # OpenAI fields quickdraft does not implement: allowed only at their neutral values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    best_of: int | None = None
    echo: bool | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "_Common":
        if self.n != 1:
            raise ValueError("n must be 1: quickdraft returns one choice per request")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported; leave it unset or 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class CompletionRequest(_Common):
    prompt: Text | list[int] | list[Text]

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: give one prompt per request (a string or token ids)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


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
