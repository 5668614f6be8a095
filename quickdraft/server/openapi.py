"""The published OpenAPI schema, made true to the server: errors are OpenAI bodies with the
statuses the server answers (400, never FastAPI's 422), generation answers JSON or an event
stream, and what is known only once a model is loaded (its vocabulary, its context, the
speculation methods it can run) is written in.

Knows nothing about the engine.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from quickdraft.server.guards import ANTHROPIC


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


STATUSES = {
    400: "Malformed JSON, a field of the wrong type or out of range, an unsupported field, a prompt "
         "past the context (code context_length_exceeded), or a Host header not answered (code invalid_host)",
    401: "No or a wrong API key (Authorization: Bearer)",
    404: "A model this server does not serve (code model_not_found), or a response it does not keep "
         "(/v1/responses)",
    408: "The request's headers or body did not arrive in time (--header-timeout, --body-timeout; code "
         "request_timeout); the connection is closed",
    413: "A body larger than --max-body-bytes",
    429: "The waiting queue is full (--max-waiting); retry after Retry-After seconds",
    500: "Generation failed inside the engine",
    503: "The server is shutting down (code server_shutting_down), or has --max-connections open (code "
         "too_many_connections; retry after Retry-After seconds)",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": STATUSES[status]} for status in statuses}


_COUNTS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
# quickdraft's extension of each stream chunk (docs/server.md, "Token origins"); OpenAI clients ignore it
TOKEN_ORIGINS = {
    "type": "object", "required": ["pass", "tokens", "new_tokens", "committed_tokens", "elapsed_s", "ttft_s", "drafted_at", "accepted_at"],
    "description": "Where each token of this chunk came from, and the request's running statistics",
    "properties": {
        "pass": {"type": "integer", "minimum": 1, "description": "target passes so far, the prefill being 1"},
        "tokens": {"type": "array", "items": {
            "type": "object", "required": ["id", "text", "origin", "depth"],
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "text": {"type": "string", "description": "the text this token released"},
                "origin": {"enum": ["accepted", "branch", "recovered", "bonus", "target"]},
                "depth": {"type": "integer", "minimum": 0, "description": "position in the draft (0: none)"},
                "source": {"anyOf": [{"type": "string"}, {"type": "null"}],
                           "description": "for a draft token, the part of the proposer that drafted it "
                                          "(ngram, head, draft, store) where the proposer has several; else null"}}}},
        "new_tokens": {"type": "integer", "minimum": 0},
        "committed_tokens": {"type": "integer", "minimum": 0,
                             "description": "tokens the passes committed: new_tokens and a stop token's"},
        "elapsed_s": {"type": "number"}, "ttft_s": {"type": "number"},
        "drafted_at": _COUNTS, "accepted_at": _COUNTS}}
# each event's data: a chunk, an error, or the closing "[DONE]"
EVENT = {"anyOf": [{"type": "object", "properties": {"choices": {"type": "array"}, "error": {"type": "object"},
                                                     "quickdraft": TOKEN_ORIGINS}},
                   {"type": "string", "enum": ["[DONE]"]}]}
GENERATION: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion as JSON, or with stream: true server-sent events ending with "
                         "data: [DONE]",
          "content": {"text/event-stream": {"schema": EVENT}}},
}


def publish(app: FastAPI, model_name: str, vocab_size: int, max_seq_len: int, methods: Callable[[], list[str]],
            max_body_bytes: int, bearer: bool = False, max_choices: int | None = None) -> None:
    """Replace FastAPI's schema generation with one that drops the 422s the server never sends,
    names the one model served, bounds token ids by its vocabulary and new tokens by its context
    (the prompt takes at least one of them), text by the body limit and a prompt's token ids by the
    context, and lists the speculation methods this server can run (`methods()`, asked when the
    schema is first requested); bearer: /v1 routes need an API key; max_choices: the most choices (n)
    a request may ask for here, and prompts of a batch (None: as the request model bounds them)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # a route of two methods: its operations are named apart below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():
                for method, operation in operations.items():
                    operation.get("responses", {}).pop("422", None)
                    # FastAPI names all of a route's operations after one of its methods; each after its own
                    operation["operationId"] = f"{operation['operationId'].rsplit('_', 1)[0]}_{method}"
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for request in ("CompletionRequest", "ChatCompletionRequest"):
                fields = components[request]["properties"]
                fields["model"]["enum"] = [model_name]  # any other is a 404
                for name in ("max_tokens", "max_completion_tokens"):
                    if name in fields:
                        fields[name]["anyOf"][0]["maximum"] = max_seq_len - 1
                if max_choices is not None:
                    fields["n"]["maximum"] = min(fields["n"]["maximum"], max_choices)
            responses = components["ResponsesRequest"]["properties"]  # /v1/responses (responses_api.py)
            responses["model"]["enum"] = [model_name]
            responses["max_output_tokens"]["anyOf"][0]["maximum"] = max_seq_len - 1
            for request in ("MessagesRequest", "CountTokensRequest"):  # /v1/messages (messages_api.py)
                components[request]["properties"]["model"]["enum"] = [model_name]
            components["MessagesRequest"]["properties"]["max_tokens"]["maximum"] = max_seq_len - 1
            method = components["Speculative"]["properties"]["method"]["anyOf"][0]
            method["enum"] = methods()
            for form in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
                for ids in (form, form.get("items", {})):  # token ids: one prompt's, or each of a batch's
                    if ids.get("items", {}).get("type") == "integer":
                        ids["items"].update(minimum=0, maximum=vocab_size - 1)
                        ids["maxItems"] = max_seq_len - 1
                if "maxItems" in form and form["items"].get("type") != "integer" and max_choices is not None:
                    form["maxItems"] = min(form["maxItems"], max_choices)  # a batch: each prompt's choices take places
            for request in ("CompletionRequest", "ChatCompletionRequest"):  # logit_bias's keys: token ids
                bias = components[request]["properties"]["logit_bias"]["anyOf"][0]
                bias["propertyNames"] = {"pattern": ids_up_to(vocab_size - 1)}
            _text_bounds(components, max_body_bytes)
            if bearer:
                schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"},
                                                            "xApiKey": {"type": "apiKey", "in": "header",
                                                                        "name": "x-api-key"}}
                for path, operations in schema["paths"].items():
                    for operation in operations.values():
                        if path.startswith("/v1"):  # Anthropic's routes take either header
                            operation["security"] = [{"apiKey": []}, *([{"xApiKey": []}] if path.startswith(
                                ANTHROPIC) else [])]
            _integer_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def ids_up_to(m: int) -> str:
    """A regular expression for the decimal numbers 0..m, written without leading zeros."""
    digits = str(m)
    forms = ["0", *("[1-9]" + (f"[0-9]{{{d - 1}}}" if d > 1 else "") for d in range(1, len(digits)))]
    for i, top in enumerate(digits):  # as long as m: equal to it up to digit i, then below it there
        low = 1 if i == 0 else 0
        if int(top) > low:
            rest = len(digits) - i - 1
            forms.append(f"{digits[:i]}[{low}-{int(top) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    forms.append(digits)
    return "^(" + "|".join(forms) + ")$"


def _text_bounds(components: dict[str, Any], max_body_bytes: int) -> None:
    """Text that reaches the tokenizer has no bound of its own but the body's (a character is at
    least a byte), which is this server's to write in."""
    strings = [components["TextPart"]["properties"]["text"], components["ToolCallFunction"]["properties"]["arguments"]]
    strings += [form for name in ("content", "reasoning_content")
                for form in components["ChatMessage"]["properties"][name]["anyOf"] if form.get("type") == "string"]
    for form in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        strings.append(form if form["type"] == "string" else form["items"])
    responses = [components["ResponsesRequest"]["properties"][name] for name in ("input", "instructions")]
    responses += [components[model]["properties"][name] for model, name in (
        ("MessageItem", "content"), ("ContentPart", "text"), ("FunctionCallItem", "arguments"),
        ("FunctionCallOutputItem", "output"), ("ReasoningText", "text"))]
    strings += [form for field in responses for form in field.get("anyOf", [field])]
    messages = [components[model]["properties"][name] for model, name in (
        ("MessagesRequest", "system"), ("CountTokensRequest", "system"), ("UserMessage", "content"),
        ("AssistantMessage", "content"), ("SystemMessage", "content"), ("TextBlock", "text"),
        ("ToolResultBlock", "content"), ("ThinkingBlock", "thinking"))]
    strings += [form for field in messages for form in field.get("anyOf", [field])]
    for form in strings:
        if form.get("type") == "string":
            form["maxLength"] = max_body_bytes


def _integer_bounds(schema: Any) -> None:
    """FastAPI's OpenAPI model holds bounds as floats ("minimum": 1.0): an integer's bounds are
    written back as integers. Only bounds a float holds exactly survive (hence seed < 2**63, not
    <= 2**63 - 1, which a float rounds up to 2**63)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(schema.get(key), float):
                    schema[key] = int(schema[key])
        for value in schema.values():
            _integer_bounds(value)
    elif isinstance(schema, list):
        for value in schema:
            _integer_bounds(value)
