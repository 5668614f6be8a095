"""Every refusal as an OpenAI error body with the right status: request validation, the app's own
checks (BadRequest) and the request pipeline's (RequestError), quickdraft's other errors and Starlette's HTTP errors (404, 405, 413).

Knows nothing about the engine.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from quickdraft.errors import QuickdraftError, RequestError
from quickdraft.server import responses as out
from quickdraft.server.guards import QueueFull, body_too_large

FIELD = re.compile(r"[a-z_][a-z0-9_]*")
TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


class BadRequest(RequestError):
    """A refusal with its HTTP status; the request pipeline's own (RequestError) are 400s."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param, code)
        self.status, self.message = status, message

    @classmethod
    def of(cls, e: RequestError) -> BadRequest:
        return e if isinstance(e, BadRequest) else cls(400, str(e), e.param, e.code)


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: of the errors one value got from the members of a
    union, the one about a member whose type it has (else the deepest: [true] against str | list[int]
    is about its item, not about not being a string); the path without the members' labels
    ("prompt.function-after[...]" -> "prompt")."""
    if not errors:
        return "invalid request", None
    deepest = max(errors, key=lambda e: len(e["loc"]))  # the first of the deepest
    first = next((e for e in errors if not e["type"].endswith("_type")), deepest)
    path = [str(p) for p in first["loc"][1:] if isinstance(p, int) or (FIELD.fullmatch(p) and p not in TYPE_NAMES)]
    where = ".".join(path)
    error = first.get("ctx", {}).get("error")
    # a validator's own ValueError says what was expected; pydantic would prefix "Value error, "
    message = str(error) if first["type"] == "value_error" and error is not None else first["msg"]
    if first["type"] == "string_unicode":  # pydantic's own check, for constrained strings
        message = "found a lone surrogate (such as \\ud800); expected valid Unicode text"
    if first["type"] == "extra_forbidden":
        message = "unknown field (quickdraft refuses fields it does not implement rather than ignore them)"
    return (f"{where}: {message}" if where else message), where or None


def endpoints(app: FastAPI) -> list[str]:
    """The API's routes as "METHOD /path" (the published ones: not the playground's files or docs)."""
    return [f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute) and route.include_in_schema
            for method in sorted(route.methods - {"HEAD"})]


def install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if errors and errors[0]["type"] == "json_invalid":
            return out.error_response(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
        message, param = validation_error(errors)
        return out.error_response(400, message, param=param)

    @app.exception_handler(RequestError)  # BadRequest's too
    async def bad(_: HTTPRequest, exc: RequestError) -> JSONResponse:
        exc = BadRequest.of(exc)
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return out.error_response(exc.status, exc.message, kind, exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def full(_: HTTPRequest, exc: QueueFull) -> JSONResponse:
        return exc.response()

    @app.exception_handler(QuickdraftError)
    async def quickdraft_error(_: HTTPRequest, exc: QuickdraftError) -> JSONResponse:
        return out.error_response(400, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route: say which there are
            message = f"{request.method} {request.url.path} is not an endpoint of this server; it serves " \
                      f"{', '.join(endpoints(request.app))}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not answer {request.method}; it answers {exc.headers['Allow']}"
        elif exc.status_code == 413:  # raised by FastAPI's max_body_size as the body streams in
            message = body_too_large(max_body_bytes)
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            message = f"the body is not JSON in UTF-8: {exc.__cause__}"
        return out.error_response(exc.status_code, message, kind, headers=exc.headers)  # 405's Allow
