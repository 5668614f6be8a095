"""A request's prompt on its way to token ids: a chat rendered as the model's template takes it, a
text tokenized so that one past the context is refused from a prefix (its tokenizer work bounded
by the context, not by the text), token ids checked against the vocabulary. Plain functions of the
tokenizer; the server runs them on its tokenizer threads (server/prompts.py), the Python API in
the caller's thread. Knows the tokenizer and the chat layer, not the engine or HTTP.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError

from quickdraft.errors import ContextTooLong, QuickdraftError, RequestError
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.structured.conversation import conversation
from quickdraft.structured.tools import Syntax, Tools

PREFIX_CHARS = 8         # a prompt's first prefix: this many characters per token of the context (~2x English's)
PREFIX_SLACK = 64        # a prefix refuses once it alone makes the context, this many tokens and the bytes of
                         # the longest token more: its cut end tokenizes otherwise than the whole text only in the
                         # token or word it cuts (a 256-byte token cut: up to 255 one-byte tokens)
EFFORTS = ("low", "medium", "high")  # the reasoning efforts gpt-oss's template writes (its default: medium)


def text_of(tokenizer: Tokenizer, syntax: Syntax, messages: Sequence[Mapping[str, Any]], tools: Tools | None,
            effort: str | None = None) -> str:
    """A chat's prompt text: its messages (conversation.template_message normalizes roles and text
    parts) and the tools the reply may call, as the model's chat template writes them; a message
    the template cannot take is a RequestError naming `messages`. effort: the reasoning effort of a
    harmony template (check_effort), None: the template's default."""
    check_effort(syntax, effort)
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise RequestError(f"messages: expected a list of chat messages, found {type(messages).__name__}", "messages")
    if odd := [m for m in messages if not isinstance(m, Mapping)][:1]:  # a list: None is a message too
        raise RequestError(f"chat messages are objects with a role and content, found {odd[0]!r}", "messages")
    try:
        turns, listed = conversation(messages, tools, syntax)
        return tokenizer.chat_text(turns, True, listed) if effort is None else _with_effort(tokenizer, turns, listed,
                                                                                            effort)
    except RequestError:
        raise
    except (QuickdraftError, ValueError) as e:
        raise RequestError(str(e), "messages") from None


def check_effort(syntax: Syntax, effort: str | None) -> None:
    """A reasoning effort is for a template that reads one (harmony's), and one it knows; else a
    RequestError naming reasoning_effort."""
    if effort is None:
        return
    if not syntax.channels:
        # (the code OpenAI's API gives a reasoning effort sent to a model without reasoning)
        raise RequestError("reasoning_effort: this model's chat template takes no reasoning effort (gpt-oss's "
                           "harmony template does); leave it unset", "reasoning_effort", "unsupported_parameter")
    if effort not in EFFORTS:
        raise RequestError(f"reasoning_effort: expected one of {', '.join(EFFORTS)}, found {effort!r}",
                           "reasoning_effort")


def _with_effort(tokenizer: Tokenizer, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 effort: str) -> str:
    """The template's text with its reasoning_effort variable set, which Tokenizer.chat_text has no way
    to pass: the turns checked as chat_text checks them (the tokenizer refuses text that is no valid
    Unicode), the template's own refusal a RequestError."""
    if (odd := next((t for t in turns if not isinstance(t.get("role"), str) or
                     not isinstance(t.get("content"), str)), None)) is not None:
        raise RequestError(f"chat messages need string 'role' and 'content', found {odd!r}", "messages")
    try:
        return tokenizer.hf.apply_chat_template(turns, tools=tools, add_generation_prompt=True, tokenize=False,
                                                reasoning_effort=effort)
    except TemplateError as e:
        raise RequestError(f"the chat template cannot write this conversation: {e}", "messages") from None


def check_length(tokenizer: Tokenizer, at_least: int, context: int, note: str = "", param: str = "prompt") -> None:
    """Refuse a text whose length alone says it has at least `at_least` tokens (Tokenizer.min_tokens)
    where they cannot fit the context, before any tokenizer work. `note`: why the context ends
    there, where the model says (ModelConfig.context_note)."""
    if at_least >= context:
        raise ContextTooLong(f"the prompt has at least {at_least} tokens (from its length: no token stands for more "
                             f"than {tokenizer.bytes_per_token} bytes) but the context holds {context}{note}; "
                             f"expected at most {context - 1} so at least one token can be generated", param)


def bounded(tokenizer: Tokenizer, text: str, add_special_tokens: bool, context: int, param: str = "prompt"
            ) -> list[int]:
    """The text's token ids, tokenizing prefixes of PREFIX_CHARS * (context + slack) characters,
    then twice as many each time, up to the whole text; refused (ContextTooLong) as soon as a prefix
    alone makes context + slack tokens (slack: PREFIX_SLACK and the bytes of the longest token,
    256 where the tokenizer has no such bound). The work is under 3x the whole text's (a
    text that fits in sparse tokens, such as long runs of one character; one pass for most that fit)
    and under 4x that of the characters that make the context (a text that does not fit), whatever
    the text's length. `param`: the field the text came from (prompt, messages)."""
    slack = PREFIX_SLACK + (tokenizer.bytes_per_token or 256)
    chars = PREFIX_CHARS * (context + slack)
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens)
        if chars >= len(text):
            return ids
        if len(ids) >= context + slack:
            raise ContextTooLong(f"the prompt has at least {len(ids) - slack} tokens (its first {chars:,} "
                                 f"characters alone make {len(ids)}; tokenized no further) but the context holds "
                                 f"{context}; expected at most {context - 1} so at least one token can be generated",
                                 param)
        chars *= 2


def given(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """A prompt given as token ids (a list, a tuple, an array), each one checked to be in the
    vocabulary; a refusal names `param`."""
    if isinstance(ids, (str, bytes, bytearray, memoryview, Mapping)) or not (hasattr(ids, "__len__")
                                                                             and hasattr(ids, "__getitem__")):
        raise RequestError(f"{param}: expected a text or a list of token ids, found {type(ids).__name__}", param)
    ids = [_token_id(t) for t in ids]
    if all(0 <= t < vocab_size for t in ids):
        return ids
    raise RequestError(f"prompt token ids must be integers in 0..{vocab_size - 1}", param)


def _token_id(value: object) -> int:
    """An integer of any kind (numpy's, a 0-d tensor's) as an int; -1 for anything else (floats,
    bools: operator.index takes those as 1 and 0)."""
    if isinstance(value, bool):
        return -1
    try:
        return operator.index(value)
    except TypeError:
        return -1
