"""The aiohttp application: the route table, the middlewares, the plugins' routes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import aiohttp_cors
from aiohttp import web

from asyncengine.engine.errors import EngineOverloaded
from asyncengine.entrypoints.batch.service import BATCHES, BatchService
from asyncengine.entrypoints.http import lora, routes
from asyncengine.entrypoints.http.anthropic.messages import count_tokens, create_message
from asyncengine.entrypoints.http.anthropic.protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageObject,
    MessagesRequest,
    MessagesStreamEvent,
)
from asyncengine.entrypoints.http.auth import auth_middleware
from asyncengine.entrypoints.http.errors import APIError, error_middleware
from asyncengine.entrypoints.http.llama_server import completion as llama_native
from asyncengine.entrypoints.http.llama_server import infill as llama_infill
from asyncengine.entrypoints.http.openai.batches import BATCH_ROUTES
from asyncengine.entrypoints.http.openai.chat import create_chat_completion
from asyncengine.entrypoints.http.openai.completions import create_completion
from asyncengine.entrypoints.http.openai.embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    create_embeddings,
)
from asyncengine.entrypoints.http.openai.files import FILE_ROUTES
from asyncengine.entrypoints.http.openai.responses import create_response
from asyncengine.entrypoints.http.openai.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from asyncengine.entrypoints.http.openai.scoring_routes import SCORING_ROUTES
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
from asyncengine.entrypoints.http.router import router_routes, routing_middleware
from asyncengine.entrypoints.http.sender import BatchSender
from asyncengine.entrypoints.http.serving import REQUEST_ID_HEADER, to_api_error
from asyncengine.entrypoints.http.state import STATE, ServerSettings, ServerState, state_of
from asyncengine.entrypoints.http.tenancy import make_tenant_middleware
from asyncengine.entrypoints.http.trace_context import trace_context_middleware, tracing_enabled
from asyncengine.entrypoints.http.web import add_root_redirect, add_web_routes

if TYPE_CHECKING:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.engine.registry import ModelRegistry

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
    Route("POST", "/v1/responses", create_response, "Create a model response (stateless)",
          ResponsesRequest, ResponseObject, stream=ResponseStreamEvent),
    Route("POST", "/v1/messages", create_message, "Create a message (Anthropic's Messages API)",
          MessagesRequest, MessageObject, stream=MessagesStreamEvent, error=AnthropicError),
    Route("POST", "/v1/messages/count_tokens", count_tokens,
          "Count a message's input tokens (Anthropic's Messages API)", CountTokensRequest,
          CountTokensResponse, error=AnthropicError),
    Route("POST", "/v1/embeddings", create_embeddings, "Create embeddings",
          EmbeddingRequest, EmbeddingResponse),
    *SCORING_ROUTES,
    Route("POST", "/v1/load_lora_adapter", lora.load_lora_adapter,
          "Load a LoRA adapter (with runtime updating enabled)", lora.LoadLoRAAdapterRequest,
          content_type="text/plain", enabled=lora.updating_enabled),
    Route("POST", "/v1/unload_lora_adapter", lora.unload_lora_adapter,
          "Unload a LoRA adapter (with runtime updating enabled)",
          lora.UnloadLoRAAdapterRequest,
          content_type="text/plain", enabled=lora.updating_enabled),
    Route("GET", "/ping", routes.ping, "Liveness for load balancers (no API key needed)",
          content_type=None),
    Route("POST", "/ping", routes.ping, "Liveness for load balancers (no API key needed)",
          content_type=None),
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
    Route("POST", "/completion", llama_native.llama_completion,
          "Create a completion (llama-server's own route)", llama_native.LlamaCompletionRequest,
          llama_native.LlamaCompletion, stream=llama_native.LlamaCompletion),
    Route("POST", "/completions", llama_native.llama_completion,
          "Create a completion (llama-server's own route; as /completion)",
          llama_native.LlamaCompletionRequest, llama_native.LlamaCompletion,
          stream=llama_native.LlamaCompletion),
    Route("POST", "/infill", llama_infill.llama_infill,
          "Fill in the middle of code (llama-server's route; a model with the tokens)",
          llama_infill.LlamaInfillRequest, llama_native.LlamaCompletion,
          stream=llama_native.LlamaCompletion, enabled=llama_infill.infill_enabled),
    Route("GET", "/props", llama_native.props, "The server's properties (llama-server's)",
          response=llama_native.LlamaProps),
    Route("GET", "/openapi.json", openapi_json, "This document"),
    *FILE_ROUTES,
    *BATCH_ROUTES,
]

#: Routes that still answer while the server drains.
_DURING_DRAIN = frozenset({"/metrics"})


@web.middleware
async def draining_middleware(request: web.Request, handler) -> web.StreamResponse:
    if request.app[STATE].draining and request.path not in _DURING_DRAIN:
        raise APIError(503, "The server is shutting down.")
    return await handler(request)


#: Handlers that queue engine requests.
_QUEUEING = frozenset({create_completion, create_chat_completion, create_response,
                       create_message, llama_native.llama_completion,
                       llama_infill.llama_infill})


@web.middleware
async def overload_middleware(request: web.Request, handler) -> web.StreamResponse:
    """While the engine's queue is full (--max-queued-requests), a generation request gets
    its 503 at once: its body is not decoded, its prompt neither rendered nor tokenized
    (``add_request`` would refuse it after all that work). A storm costs less this way."""
    if request.match_info.route.handler in _QUEUEING:
        engine = state_of(request).engine
        try:
            engine.check_queue()
        except EngineOverloaded as e:
            raise to_api_error(e) from None
    return await handler(request)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``X-Request-Id`` back on every response to a request that sent one (streams too)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given and REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = given


def build_app(engine: AsyncEngine | None, metrics: EngineMetrics | None,
              settings: ServerSettings, registry: ModelRegistry | None = None
              ) -> web.Application:
    """The application serving ``engine`` (or, in router mode, the models of ``registry``,
    each request routed by its ``model``: router.py); plugins' ``register_http_routes`` hooks
    run before the routes are mirrored under --root-path and CORS is applied to all of
    them."""
    routes = BUILTIN_ROUTES
    middlewares = [error_middleware, draining_middleware]
    if settings.api_key:
        middlewares.append(auth_middleware(settings.api_key))
    if registry is not None:
        routes, routed = router_routes(BUILTIN_ROUTES, settings.sleep_mode)
        middlewares.append(routing_middleware(routed))
    middlewares.append(overload_middleware)
    middlewares.append(make_tenant_middleware(
        not settings.api_key or settings.trust_tenant_header))
    if tracing_enabled(engine):  # --otlp-traces-endpoint: requests carry their traceparent
        middlewares.append(trace_context_middleware)
    app = web.Application(client_max_size=settings.max_request_body, middlewares=middlewares)
    app[STATE] = ServerState(engine, metrics, settings, registry=registry)
    app[BATCHES] = BatchService(app[STATE])  # running inside batch_jobs(app) (server.py)
    app[ROUTES] = list(routes)
    for r in routes:
        app.router.add_route(r.method, r.path, r.handler)
    add_web_routes(app, settings)  # the chat page at /, unless --no-web-ui
    _register_plugin_routes(app, engine)
    if settings.root_path:
        _mirror_under(app, settings.root_path)
    add_root_redirect(app, settings)
    app.on_response_prepare.append(_echo_request_id)  # before CORS lists the headers to expose
    _enable_cors(app, settings)
    app.cleanup_ctx.append(_batch_sender)
    return app


async def _batch_sender(app: web.Application):
    """The thread that sends pushed SSE frames (sender.py), for the life of the app; the
    engine flushes it after each step's emission."""
    state = app[STATE]
    registry = state.registry
    listeners = getattr(state.engine, "emit_listeners", None)
    sender = BatchSender.start() if listeners is not None or registry is not None else None
    if sender is not None:
        state.sender = sender
        if registry is not None:  # every engine flushes it, as it loads
            registry.on_loaded.append(lambda engine: engine.emit_listeners.append(sender.flush))
            for entry in registry.entries.values():
                if entry.engine is not None:
                    entry.engine.emit_listeners.append(sender.flush)
        else:
            listeners.append(sender.flush)
    try:
        yield
    finally:
        if sender is not None:
            state.sender = None
            if registry is not None:
                registry.on_loaded.clear()
                for entry in registry.entries.values():
                    if entry.engine is not None and sender.flush in entry.engine.emit_listeners:
                        entry.engine.emit_listeners.remove(sender.flush)
            else:
                listeners.remove(sender.flush)
            sender.close()


def _mirror_under(app: web.Application, prefix: str) -> None:
    """Every route also answers under ``prefix`` (a proxy that keeps its path prefix)."""
    for route in list(app.router.routes()):
        path = route.resource.canonical if route.resource is not None else None
        if path is None or route.method == "*":
            continue
        app.router.add_route(route.method, prefix + path, route.handler)


def _enable_cors(app: web.Application, settings: ServerSettings) -> None:
    """CORS on every route (aiohttp-cors answers the preflights), as vLLM's defaults allow
    any origin, method and header unless --allowed-* narrow them."""
    def one(values: list[str]) -> str | list[str]:
        return "*" if "*" in values else values

    options = aiohttp_cors.ResourceOptions(
        allow_credentials=settings.allow_credentials, expose_headers="*",
        allow_headers=one(settings.allowed_headers), allow_methods=one(settings.allowed_methods))
    cors = aiohttp_cors.setup(app, defaults={o: options for o in settings.allowed_origins})
    for route in list(app.router.routes()):
        if route.method not in ("HEAD", "OPTIONS", "*"):
            cors.add(route)


def _register_plugin_routes(app: web.Application, engine: AsyncEngine) -> None:
    try:
        from asyncengine.ext.registry import get_plugin_manager
    except ImportError:  # the plugin system is optional for the server
        return
    hook = getattr(get_plugin_manager().hook, "register_http_routes", None)
    if hook is not None:
        hook(app=app, engine=engine)
