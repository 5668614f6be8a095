"""/v1/models: the one model this server serves."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from quickdraft.server.config import ServerConfig
from quickdraft.server.routes import errors
from quickdraft.server.state import served


async def models(http: HTTPRequest) -> dict:
    return {"object": "list", "data": [{"id": served(http).config.model_name, "object": "model", "created": 0,
                                        "owned_by": "quickdraft"}]}


def install(app: FastAPI, config: ServerConfig) -> None:
    app.add_api_route("/v1/models", models, methods=["GET"], responses=errors(config))
