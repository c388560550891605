"""Router mode (``--models-dir``): one server, several models, each request routed by its
``model``.

The router middleware reads the ``model`` of a generation request's body (or ``?model=`` of a
GET), takes a lease on that model's engine from the registry (``engine/registry.py``: loading
or waking it first when needed) for the length of the handler, and hands the handler a
``ServerState`` bound to that engine: the handlers are the single-model server's, unchanged,
for every API family (OpenAI, Anthropic, llama-server).

The routes of its own, with llama-server's and vLLM's names: ``GET /models`` (and
``/v1/models``) with each model's status, ``POST /models/load`` and ``/models/unload`` (behind
the API key, as every route but ``/health``, ``/ping`` and ``/metrics``), and with
``--enable-sleep-mode`` ``POST /sleep?level=1|2``, ``POST /wake_up`` and ``GET /is_sleeping``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from asyncengine.engine.catalog import PathRefused, build_catalog, model_file, resolve_inside
from asyncengine.engine.registry import (
    ModelEntry,
    ModelNotFound,
    ModelRegistry,
    ModelStatus,
    ModelUnavailable,
)
from asyncengine.entrypoints.http.errors import APIError, bad_request, from_decode_error
from asyncengine.entrypoints.http.openapi import Route
from asyncengine.entrypoints.http.routes import lora_adapters_in_use
from asyncengine.entrypoints.http.serving import json_response
from asyncengine.entrypoints.http.state import ROUTED, STATE, ServerState


class _ModelField(msgspec.Struct):
    model: Any = None


class ModelStatusInfo(msgspec.Struct, omit_defaults=True):
    value: str
    sleep_level: int | None = None
    error: str | None = None


class RouterModelCard(msgspec.Struct):
    """A model in ``GET /models``: OpenAI's card, plus llama-server's ``status`` and path."""

    id: str
    created: int
    status: ModelStatusInfo
    aliases: list[str] = []
    path: str | None = None
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's model
    owned_by: str = "asyncengine"
    object: str = "model"


class RouterModelList(msgspec.Struct):
    data: list[RouterModelCard]
    object: str = "list"


class ModelHealth(msgspec.Struct):
    id: str
    status: str
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0


class RouterHealth(msgspec.Struct):
    """``GET /health`` of a router: ``ok``, the loaded models and their queues and pools."""

    status: str
    loaded: list[str]
    models: list[ModelHealth]


def registry_of(request: web.Request) -> ModelRegistry:
    registry = request.app[STATE].registry
    assert registry is not None
    return registry


def model_name(request: web.Request, data: bytes | None) -> str:
    """The model a request names: its body's ``model``, else ``?model=``; with one model
    known, that one. A 400 when there is no telling."""
    return named_model(registry_of(request), data, request.query.get("model"))


def named_model(registry: ModelRegistry, data: bytes | None, name: str | None = None) -> str:
    """The model a JSON body names (its ``model``, else ``name``); with one model known, that
    one. A 400 when there is no telling."""
    if data:
        try:
            body = msgspec.json.decode(data, type=_ModelField)
        except msgspec.DecodeError as e:
            raise from_decode_error(e) from None
        if body.model is not None:
            if not isinstance(body.model, str):
                raise bad_request("model must be a string", "model")
            name = body.model
    if name:
        return name
    if len(registry.entries) == 1:
        return next(iter(registry.entries))
    raise bad_request("model is required: this server serves several models (available: "
                      f"{', '.join(registry.names())})", "model")


def to_api_error(error: Exception) -> APIError:
    if isinstance(error, ModelNotFound):
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, ModelUnavailable):
        return APIError(error.status, str(error), param="model", code="model_unavailable")
    raise error


def routing_middleware(routed: frozenset) -> Any:
    """A request to a handler of ``routed`` runs with its model's engine leased."""

    @web.middleware
    async def route(request: web.Request, handler) -> web.StreamResponse:
        if request.match_info.route.handler not in routed:
            return await handler(request)
        data = await request.read() if request.can_read_body else None
        async with leased_state(request.app[STATE], model_name(request, data)) as state:
            request[ROUTED] = state
            try:
                return await handler(request)
            finally:
                # A keep-alive connection keeps its last request: not the engine with it.
                request.pop(ROUTED, None)

    return route


@asynccontextmanager
async def leased_state(app_state: ServerState, name: str) -> AsyncIterator[ServerState]:
    """The handlers' state bound to the engine of the model ``name`` (loaded or woken first
    when needed), leased for the block: what a routed handler gets, and a batch's line. An
    ``APIError`` when the model is unknown or cannot serve."""
    registry = app_state.registry
    try:
        lease = registry.use(name)
        engine = await lease.__aenter__()
    except (ModelNotFound, ModelUnavailable) as e:
        raise to_api_error(e) from None
    try:
        yield _state_for(app_state, registry.resolve(name), engine)
    finally:
        await lease.__aexit__(None, None, None)


def _state_for(app_state: ServerState, entry: ModelEntry, engine: Any) -> ServerState:
    """The handlers' state bound to ``engine`` (made once per loaded engine)."""
    view = entry.extras.get("state")
    if view is None or view.engine is not engine:
        view = entry.extras["state"] = dataclasses.replace(
            app_state, engine=engine, metrics=getattr(engine, "metrics", None))
    return view


# -- the router's routes --------------------------------------------------------------------------
def _card(state: ServerState, entry: ModelEntry) -> RouterModelCard:
    engine = entry.engine
    return RouterModelCard(
        id=entry.name, created=state.created, aliases=list(entry.source.aliases),
        path=entry.source.path, max_model_len=getattr(engine, "max_model_len", None),
        status=ModelStatusInfo(str(entry.status), entry.sleep_level or None, entry.error))


async def list_models(request: web.Request) -> web.Response:
    """Every model, then every LoRA adapter (its preset's, and those loaded at run time)
    with its model as ``parent``."""
    state = request.app[STATE]
    registry = registry_of(request)
    cards = [_card(state, e) for e in registry.entries.values()]
    for entry in registry.entries.values():
        names = dict.fromkeys(registry.adapters_of(entry))
        lora_names = getattr(entry.engine, "lora_names", None)
        if lora_names is not None:
            names.update(dict.fromkeys(lora_names()))
        for name in names:
            card = _card(state, entry)
            card.id, card.aliases, card.parent = name, [], entry.name
            cards.append(card)
    return json_response(RouterModelList(cards))


async def retrieve_model(request: web.Request) -> web.Response:
    try:
        entry = registry_of(request).resolve(request.match_info["model"])
    except ModelNotFound as e:
        raise to_api_error(e) from None
    return json_response(_card(request.app[STATE], entry))


async def _named(request: web.Request) -> str:
    data = await request.read()
    return model_name(request, data if data else None)


async def load_model(request: web.Request) -> web.Response:
    """``POST /models/load {"model": NAME}``: NAME is a model's name, or a path inside
    ``--models-dir`` (a model added since the server started)."""
    registry = registry_of(request)
    name = await _named(request)
    if name not in registry.names():
        name = _add_from_dir(request, name)
    try:
        entry = await registry.load(name)
    except (ModelNotFound, ModelUnavailable) as e:
        raise to_api_error(e) from None
    return json_response({"success": True, "model": _card(request.app[STATE], entry)})


def _add_from_dir(request: web.Request, given: str) -> str:
    registry = registry_of(request)
    root = request.app[STATE].settings.models_dir
    if root is None:
        raise to_api_error(ModelNotFound(given, registry.names()))
    try:
        target = resolve_inside(root, given)
    except PathRefused as e:
        raise bad_request(f"{e}; give a model's name or a path inside the models directory",
                          "model") from None
    if not target.exists():
        raise to_api_error(ModelNotFound(given, registry.names()))
    file = model_file(target)
    if file is None:
        raise bad_request(f"model path {given!r} holds no model (a .gguf file, or a directory "
                          "with config.json or a .gguf file)", "model")
    for entry in registry.entries.values():
        if entry.source.path == str(file):
            return entry.name
    found = build_catalog(str(target.parent), {}, embedded=False)
    wanted = target.name[:-len(".gguf")] if target.is_file() else target.name
    source = next(s for s in found if s.name == wanted)
    source.name = given
    registry.add(source)
    return given


async def unload_model(request: web.Request) -> web.Response:
    try:
        entry = await registry_of(request).unload(await _named(request))
    except ModelNotFound as e:
        raise to_api_error(e) from None
    return json_response({"success": True, "model": _card(request.app[STATE], entry)})


def _targets(request: web.Request) -> list[str]:
    """``?model=`` (or the body's), else every model."""
    registry = registry_of(request)
    name = request.query.get("model")
    if name is None:
        return list(registry.entries)
    try:
        return [registry.resolve(name).name]
    except ModelNotFound as e:
        raise to_api_error(e) from None


async def sleep(request: web.Request) -> web.Response:
    """vLLM's ``POST /sleep?level=1|2`` (``&model=NAME``; every loaded model without it)."""
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {raw!r}", "level")
    registry = registry_of(request)
    for name in _targets(request):
        await registry.sleep(name, int(raw))
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    registry = registry_of(request)
    for name in _targets(request):
        try:
            await registry.wake(name)
        except ModelUnavailable as e:
            raise to_api_error(e) from None
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    registry = registry_of(request)
    states = {n: registry.entries[n].status == ModelStatus.SLEEPING for n in _targets(request)}
    asleep = bool(states) and all(states.values()) if "model" in request.query else any(
        states.values())
    return web.json_response({"is_sleeping": asleep, "models": states})


async def health(request: web.Request) -> web.Response:
    models = []
    for entry in registry_of(request).entries.values():
        item = ModelHealth(entry.name, str(entry.status))
        engine = entry.engine
        if engine is not None and entry.status == ModelStatus.LOADED:
            stats = engine.stats()
            item.num_requests_running, item.num_requests_waiting = (stats.num_running,
                                                                    stats.num_waiting)
            item.num_free_blocks, item.num_total_blocks = (stats.num_free_blocks,
                                                           stats.num_total_blocks)
        models.append(item)
    loaded = [m.id for m in models if m.status == ModelStatus.LOADED]
    return json_response(RouterHealth("ok", loaded, models))


async def ping(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """Every loaded model's series, each labelled with its ``model_name``, in one exposition."""
    from asyncengine.engine.metrics import render_many

    sources = []
    for entry in registry_of(request).entries.values():
        engine = entry.engine
        m = getattr(engine, "metrics", None)
        if engine is None or m is None or entry.status != ModelStatus.LOADED:
            continue
        transfer = getattr(engine, "kv_transfer", None)
        m.set_stats(engine.stats(), None if transfer is None else transfer.num_loaded_tokens)
        if getattr(engine, "lora", None) is not None:
            m.set_lora(*lora_adapters_in_use(engine.scheduler), engine.config.lora.max_loras)
        sources.append(m)
    return web.Response(body=render_many(sources), headers={"Content-Type": CONTENT_TYPE_LATEST})



class LoadModelRequest(msgspec.Struct):
    model: str


class SleepQuery(msgspec.Struct):
    level: int = 1
    model: str | None = None


#: The single-model routes a router answers itself (by path and method).
_REPLACED = {("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"),
             ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics")}
#: The Batch API's routes: not routed by model (each line of a batch is, by its own).
_BATCH_API = ("/v1/files", "/v1/batches")


def router_routes(builtin: list[Route], sleep_mode: bool) -> tuple[list[Route], frozenset]:
    """The routes of a router server, and the handlers routed by model: every single-model
    route that takes a request for a model (OpenAI, Anthropic, llama-server, tokenize...)."""
    kept = [r for r in builtin if (r.method, r.path) not in _REPLACED
            and r.path != "/openapi.json"]
    routed = frozenset(r.handler for r in kept if (r.method == "POST" or r.path == "/props")
                       and not r.path.startswith(_BATCH_API))
    own = [
        Route("GET", "/models", list_models, "Every model and its status (router mode)",
              response=RouterModelList),
        Route("GET", "/v1/models", list_models, "Every model and its status",
              response=RouterModelList),
        Route("GET", "/v1/models/{model}", retrieve_model, "A model and its status",
              response=RouterModelCard),
        Route("POST", "/models/load", load_model, "Load a model (llama-server's router)",
              LoadModelRequest),
        Route("POST", "/models/unload", unload_model,
              "Unload a model; its requests finish first (llama-server's router)",
              LoadModelRequest),
        Route("GET", "/health", health, "Liveness and the loaded models (no API key needed)",
              response=RouterHealth),
        Route("GET", "/ping", ping, "Liveness (no API key needed)", content_type=None),
        Route("POST", "/ping", ping, "Liveness (no API key needed)", content_type=None),
        Route("GET", "/metrics", metrics, "Prometheus metrics of every loaded model",
              content_type="text/plain"),
    ]
    if sleep_mode:
        own += [
            Route("POST", "/sleep", sleep, "Put models to sleep (vLLM's; level 1: the KV "
                  "cache freed, 2: the weights too)", content_type=None, query=SleepQuery),
            Route("POST", "/wake_up", wake_up, "Wake sleeping models (vLLM's)",
                  content_type=None, query=SleepQuery),
            Route("GET", "/is_sleeping", is_sleeping, "Whether models sleep (vLLM's)",
                  query=SleepQuery),
        ]
    openapi = next(r for r in builtin if r.path == "/openapi.json")
    return [*kept, *own, openapi], routed
