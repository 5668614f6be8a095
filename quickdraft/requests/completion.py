"""A whole generation as the Python API returns it: its chunks' text, ids and log-probabilities joined,
and a chat's reply read as the server reads it (reply.py) into its content, reasoning and tool calls.
Knows the pipeline's ends, not the engine or HTTP.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal

from quickdraft.engine.events import FinishReason, GenerationStats
from quickdraft.requests.reply import finish, parsed, read
from quickdraft.requests.text import Chunk
from quickdraft.spec.logprobs import TokenLogprob
from quickdraft.structured.conversation import call_id
from quickdraft.structured.tools import Syntax, Tools


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's shape, as a conversation's history holds it."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class Completion:
    text: str  # all the model wrote (token_ids decoded): a tool syntax's calls, harmony's markers
    token_ids: list[int]
    finish_reason: FinishReason | Literal["tool_calls"]  # tool_calls: the reply's calls are whole
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(token_ids)] if params.logprobs is set
    content: str = ""  # the answer: the text outside the tool calls and the reasoning (all of it for a prompt)
    tool_calls: list[ToolCall] = field(default_factory=list)  # whole calls only: one cut short is left out
    reasoning: str = ""  # a harmony model's analysis channel (reply.py), kept out of the content

    @property
    def message(self) -> dict[str, Any]:
        """The reply as an assistant message, to go on a conversation (a tool result after it); its
        reasoning goes with it, which gpt-oss's template writes before a call it goes on from."""
        calls = {"tool_calls": [c.as_openai() for c in self.tool_calls]} if self.tool_calls else {}
        reasoning = {"reasoning_content": self.reasoning} if self.reasoning else {}
        return {"role": "assistant", "content": self.content, **reasoning, **calls}


def completion(chunks: Iterable[Chunk], syntax: Syntax, tools: Tools | None, chat: bool) -> Completion:
    """The chunks of one generation (the last one ends it) as a Completion; `chat`: the prompt was
    messages, so the reply is read (its calls' arguments parsed, finish_reason "tool_calls" once
    they are whole)."""
    text, tokens, logprobs = [], [], []
    for chunk in chunks:
        text.append(chunk.text)
        tokens.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
    done = Completion("".join(text), tokens, chunk.finish_reason or "length", chunk.stats, logprobs, "".join(text))
    if not chat or not parsed(syntax, tools):
        return done
    reply = read(syntax, tools, done.text)
    request_id = uuid.uuid4().hex
    return replace(done, content=reply.content, reasoning=reply.reasoning,
                   tool_calls=[ToolCall(call_id(request_id, i), c.name, json.loads(c.arguments))
                               for i, c in enumerate(reply.calls)],
                   finish_reason=finish(done.finish_reason, reply.complete))
