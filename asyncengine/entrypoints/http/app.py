"""The aiohttp application: the route table, the middlewares, the plugins' routes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from asyncengine.entrypoints.http import routes
from asyncengine.entrypoints.http.auth import auth_middleware
from asyncengine.entrypoints.http.chat import create_chat_completion
from asyncengine.entrypoints.http.completions import create_completion
from asyncengine.entrypoints.http.errors import APIError, error_middleware
from asyncengine.entrypoints.http.openapi import ROUTES, Route, openapi_json
from asyncengine.entrypoints.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from asyncengine.entrypoints.http.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from asyncengine.entrypoints.http.state import STATE, ServerSettings, ServerState

if TYPE_CHECKING:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.metrics import EngineMetrics

logger = logging.getLogger("asyncengine.entrypoints.http")

BUILTIN_ROUTES = [
    Route("POST", "/v1/completions", create_completion, "Create a completion",
          CompletionRequest, Completion, stream=Completion),
    Route("POST", "/v1/chat/completions", create_chat_completion, "Create a chat completion",
          ChatCompletionRequest, ChatCompletion, stream=ChatCompletionChunk),
    Route("GET", "/v1/models", routes.list_models, "List the served models",
          response=ModelList),
    Route("GET", "/v1/models/{model}", routes.retrieve_model, "Describe a served model",
          response=ModelCard),
    Route("GET", "/health", routes.health,
          "Liveness, queue lengths and the KV-cache block pool (no API key needed)",
          response=HealthResponse),
    Route("GET", "/metrics", routes.metrics, "Prometheus metrics (no API key needed)",
          content_type="text/plain"),
    Route("POST", "/tokenize", routes.tokenize, "Tokenize a prompt or a conversation",
          TokenizeRequest, TokenizeResponse),
    Route("POST", "/detokenize", routes.detokenize, "Turn token ids back into text",
          DetokenizeRequest, DetokenizeResponse),
    Route("GET", "/version", routes.get_version, "The server's version",
          response=VersionResponse),
    Route("GET", "/openapi.json", openapi_json, "This document"),
]

#: Routes that still answer while the server drains.
_DURING_DRAIN = frozenset({"/metrics"})


@web.middleware
async def draining_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.app[STATE].draining and request.path not in _DURING_DRAIN:
        raise APIError(503, "The server is shutting down.")
    return await handler(request)


def build_app(engine: AsyncEngine, metrics: EngineMetrics | None,
              settings: ServerSettings) -> web.Application:
    """The application serving ``engine``; plugins' ``register_http_routes`` hooks run last."""
    middlewares = [error_middleware, draining_middleware]
    if settings.api_key:
        middlewares.append(auth_middleware(settings.api_key))
    app = web.Application(client_max_size=settings.max_request_body, middlewares=middlewares)
    app[STATE] = ServerState(engine, metrics, settings)
    app[ROUTES] = list(BUILTIN_ROUTES)
    for r in BUILTIN_ROUTES:
        app.router.add_route(r.method, r.path, r.handler)
    _register_plugin_routes(app, engine)
    return app


def _register_plugin_routes(app: web.Application, engine: AsyncEngine) -> None:
    try:
        from asyncengine.ext.registry import get_plugin_manager
    except ImportError:  # the plugin system is optional for the server
        return
    hook = getattr(get_plugin_manager().hook, "register_http_routes", None)
    if hook is not None:
        hook(app=app, engine=engine)
