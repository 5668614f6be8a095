"""OpenAI's Responses API on its way out: the chat route's answer as a response object, whole (from a
chat completion) or as Responses events (from its stream chunks), with sequence numbers.

A reply is output items: a harmony model's reasoning item first, a message item with the text (when
there is text, or nothing else) and a function_call item per call, in the order the model wrote them.
Pure functions and one event-numbering class; knows the chat route's bodies (responses.py,
tool_calls.py), not the engine.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from quickdraft.server.responses_api import FunctionToolChoice, Item, ResponsesRequest

DONE = ("stop", "tool_calls")  # a chat finish_reason of a whole answer; any other leaves it incomplete
OUT_OF_TOKENS = {"length": "max_output_tokens"}  # chat's finish_reason -> incomplete_details.reason


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> Item:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> Item:
    """A harmony model's reasoning, whole in its content (no summary: the model writes none)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


# a text item's type -> its text events' types' prefix
TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def status_of(finish_reason: str) -> str:
    return "completed" if finish_reason in DONE else "incomplete"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage as a response's."""
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            # cache_write_tokens: OpenAI's billed writes to an explicit cache; quickdraft bills none
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": chat_usage["completion_tokens_details"]["reasoning_tokens"]}}


def response(body: ResponsesRequest, response_id: str, created_at: int, output: list[Item],
             finish_reason: str | None, chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response object: its output and usage, and the request's settings echoed as OpenAI does.
    finish_reason None: still in progress (no usage yet)."""
    status = "in_progress" if finish_reason is None else status_of(finish_reason)
    incomplete = {"reason": OUT_OF_TOKENS.get(finish_reason, finish_reason)} if status == "incomplete" else None
    choice = body.tool_choice
    tool_choice = choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or "auto"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "error": None,
        "incomplete_details": incomplete, "model": body.model, "output": output,
        "usage": usage(chat_usage) if chat_usage is not None else None,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()], "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
        "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text is not None and body.text.format is not None else {"type": "text"}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning is not None else None, "summary": None},
        "metadata": body.metadata or {}, "store": body.store,
        "truncation": "disabled", "background": False, "service_tier": "default", "user": body.user}


def output_of(completion: dict[str, Any]) -> tuple[list[Item], str]:
    """A whole chat completion's reply as output items, and its finish_reason."""
    choice = completion["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    calls, reasoning = message.get("tool_calls") or [], message.get("reasoning_content")
    items = [reasoning_item(new_id("rs"), reasoning, "completed")] if reasoning else []
    items += [message_item(new_id("msg"), message["content"] or "", "completed")] \
        if message["content"] or not (calls or items) else []
    items += [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
              for c in calls]
    items[-1]["status"] = status_of(finish)  # as a stream leaves them: only the last item can be cut short
    return items, finish


class Events:
    """One streamed answer's Responses events, from the chat answer's chunks (streaming.chunks): items opened as their
    first text or call arrives, their deltas, and each closed when the next opens or the answer ends."""

    def __init__(self, body: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.body, self.id, self.created_at = body, response_id, created_at
        self.sequence = 0
        self.output: list[Item] = []   # the items so far, the last one open until closed
        self.open = False
        self.final: dict[str, Any] | None = None  # the response, once the answer has ended

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        now = response(self.body, self.id, self.created_at, [], None, None)
        return [self.event("response.created", response=now), self.event("response.in_progress", response=now)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """A chat chunk's events; its error, an error event."""
        if "error" in chunk:
            error = chunk["error"]
            return [self.event("error", code=error.get("code") or error["type"], message=error["message"],
                               param=error.get("param"))]
        choice = chunk["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"]
        events = self._text("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []
        events += self._text("message", delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if finish is not None:
            events += self._end(finish, chunk["usage"])
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        """Text of a message or reasoning item (`kind`), in the open one of its kind or a new one."""
        events = [] if self.open and self.output[-1]["type"] == kind else self._close("completed")
        if not self.open:
            events += self._open_text(kind)
        self.output[-1]["content"][0]["text"] += text
        logprobs = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(f"{TEXT_EVENTS[kind]}.delta", item_id=self.output[-1]["id"],
                                    output_index=len(self.output) - 1, content_index=0, delta=text, **logprobs)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A call's first piece names it (a new item); the rest are its arguments."""
        events = []
        if "id" in call:
            events += self._close("completed")
            events += self._open(call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
        pieces = call["function"]["arguments"]
        if pieces:
            self.output[-1]["arguments"] += pieces
            events.append(self.event("response.function_call_arguments.delta", item_id=self.output[-1]["id"],
                                     output_index=len(self.output) - 1, delta=pieces))
        return events

    def _open_text(self, kind: str) -> list[str]:
        item = message_item(new_id("msg"), "", "in_progress") if kind == "message" else \
            reasoning_item(new_id("rs"), "", "in_progress")
        events = self._open(item)
        return events + [self.event("response.content_part.added", item_id=item["id"],
                                    output_index=len(self.output) - 1, content_index=0,
                                    part={**item["content"][0], "text": ""})]

    def _open(self, item: Item) -> list[str]:
        self.output.append(item)
        self.open = True
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _close(self, status: str) -> list[str]:
        """The open item's closing events, or none."""
        if not self.open:
            return []
        self.open = False
        item, index = self.output[-1], len(self.output) - 1
        item["status"] = status
        if item["type"] in TEXT_EVENTS:
            part = item["content"][0]
            logprobs = {"logprobs": []} if item["type"] == "message" else {}
            events = [self.event(f"{TEXT_EVENTS[item['type']]}.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], **logprobs),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def _end(self, finish: str, chat_usage: dict[str, Any]) -> list[str]:
        """The last item closed (an empty message where the reply had none), then the response."""
        events = [] if self.output else self._open_text("message")
        events += self._close(status_of(finish))
        self.final = response(self.body, self.id, self.created_at, self.output, finish, chat_usage)
        kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.final)]
