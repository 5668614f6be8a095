"""/v1/responses: OpenAI's Responses API, an adapter over the chat route. A request becomes the chat
request it is (responses_api.py), which the chat route's own code checks, renders and tokenizes
(routes/chat.py `prepared`) and the engine answers as any chat (streaming.py); the answer's
completion or chunks become a response object or Responses events (responses_answer.py). Responses
with store: true are kept (response_store.py, on `app.state.responses`) for GET and DELETE
/v1/responses/{id} and to be continued with previous_response_id.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import FastAPI, Path
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quickdraft.errors import RequestError
from quickdraft.server.config import ServerConfig
from quickdraft.server.errors import BadRequest
from quickdraft.server.guards import TENANT
from quickdraft.server.response_store import MAX_BYTES, MAX_RESPONSES, ResponseStore, Stored
from quickdraft.server.responses_answer import Events, new_id, output_of, response
from quickdraft.server.responses_api import Item, ResponsesRequest, chat_request, renamed
from quickdraft.server.routes import errors
from quickdraft.server.routes.chat import prepared
from quickdraft.server.schemas import MAX_NAME_CHARS
from quickdraft.server.state import served
from quickdraft.server.streaming import chunks, completed, submit

ResponseId = Annotated[str, Path(max_length=MAX_NAME_CHARS)]
# each server-sent event: its name and its JSON data, whose type is that name
EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string"},
    "data": {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"type": "object", "required": ["type", "sequence_number"],
                               "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer"}}}}}}
ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response object as JSON, or with stream: true the Responses API's server-sent events "
                         "(each named by its type), ending with response.completed or response.incomplete",
          "content": {"text/event-stream": {"schema": EVENT}}},
}


async def create(body: ResponsesRequest, http: HTTPRequest) -> Response:
    store: ResponseStore = http.app.state.responses
    items = body.items()
    if body.previous_response_id is not None:
        items = [*_stored(http, body.previous_response_id, "previous_response_id").conversation(), *items]
    arrived = time.perf_counter()
    try:
        made, params, tools = await prepared(chat_request(body, items), http)
    except RequestError as e:
        raise renamed(BadRequest.of(e)) from None
    answer = submit(served(http), "chat", made, params, arrived, tools, pieces=False)
    response_id, created_at = new_id("resp"), int(time.time())
    kept = store if body.store else None
    tenant = http.scope.get(TENANT, "")
    if body.stream:
        events = Events(body, response_id, created_at)
        return StreamingResponse(_events(chunks(answer, include_usage=False), events, kept, items, tenant),
                                 media_type="text/event-stream")
    completion = await completed(answer, http)
    if not isinstance(completion, dict):
        return completion  # the client left (499), the engine failed (500) or is shutting down (503)
    output, finish = output_of(completion)
    result = response(body, response_id, created_at, output, finish, completion["usage"])
    if kept is not None:
        kept.put(result, items, tenant)
    return JSONResponse(result)


async def _events(pieces: AsyncGenerator[dict[str, Any], None], events: Events, store: ResponseStore | None,
                  items: list[Item], tenant: str) -> AsyncGenerator[str, None]:
    """The chat answer's chunks as Responses events; the response kept once it has ended."""
    try:
        for event in events.start():
            yield event
        async for chunk in pieces:
            for event in events.chunk(chunk):
                yield event
        if store is not None and events.final is not None:
            store.put(events.final, items, tenant)
    finally:  # also when the client left: the chunks' own finally cancels the request
        await pieces.aclose()


async def stored(response_id: ResponseId, http: HTTPRequest) -> JSONResponse:
    """GET: a kept response; DELETE: drop it. One route for both, so a 405 lists both in Allow."""
    if http.method == "GET":
        return JSONResponse(_stored(http, response_id, None).response)
    if not http.app.state.responses.delete(response_id, http.scope.get(TENANT, "")):
        raise _not_stored(response_id, None)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _stored(http: HTTPRequest, response_id: str, param: str | None) -> Stored:
    """The response kept under `response_id` for this request's tenant, or a 404."""
    found = http.app.state.responses.get(response_id, http.scope.get(TENANT, ""))
    if found is None:
        raise _not_stored(response_id, param)
    return found


def _not_stored(response_id: str, param: str | None) -> BadRequest:
    """A 404; param: the field that named the response (None: the path)."""
    return BadRequest(404, f"no response {response_id!r} is stored here: unknown, made with store: false, deleted, "
                           f"or dropped (this server keeps the last {MAX_RESPONSES} responses within "
                           f"{MAX_BYTES >> 20} MiB)", param,
                      "previous_response_not_found" if param is not None else None)


def install(app: FastAPI, config: ServerConfig) -> None:
    app.state.responses = ResponseStore()
    app.add_api_route("/v1/responses", create, methods=["POST"], max_body_size=config.max_body_bytes,
                      responses={**ANSWER, **errors(config, 400, 404, 408, 413, 429, 500, 503)})
    app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"],
                      responses=errors(config, 400, 404))
