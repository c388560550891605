"""GET /openapi.json: an OpenAPI 3.2 document of every route, its body and its responses.

The schemas are generated from the msgspec Structs the handlers decode and encode, so the
document cannot drift from what the server accepts; the generation parameters carry the
ranges the server enforces (``openapi_ranges.py``). A streamed response is described with
3.2's ``itemSchema``: each server-sent event's ``data`` is a JSON chunk, an error, or
``[DONE]``. Every 503 (overloaded, shutting down) carries ``Retry-After``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.core.limits import SamplingLimits
from asyncengine.engine.multimodal import image_encoder
from asyncengine.entrypoints.http.auth import PUBLIC_PATHS
from asyncengine.entrypoints.http.images import drop_image_parts
from asyncengine.entrypoints.http.openapi_ranges import Served, publish_bounds, publish_served
from asyncengine.entrypoints.http.responses import ErrorResponse
from asyncengine.entrypoints.http.routes import package_version
from asyncengine.entrypoints.http.state import state_of


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    summary: str
    body: type | None = None
    response: type | None = None
    # The Struct of each ``data:`` event when the body asks for ``"stream": true``.
    stream: type | None = None
    content_type: str | None = "application/json"  # None: an empty body
    # Whether the served engine answers it (None: always); a route it refuses as switched
    # off (the LoRA adapter routes without runtime updating) is left out of the document.
    enabled: Callable[[Any], bool] | None = None
    # The Struct of this route's error bodies (None: OpenAI's ``ErrorResponse``).
    error: type | None = None
    # The Struct whose fields are the query parameters (all optional).
    query: type | None = None
    # The media type of ``body`` (a file upload's is ``multipart/form-data``).
    body_type: str = "application/json"


ROUTES = web.AppKey("asyncengine_routes", list)
_PATH_PARAM = re.compile(r"{(\w+)}")


#: Routes that never answer 503 (they keep answering while the server drains).
NEVER_UNAVAILABLE = frozenset({"/metrics"})


def _event_stream(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """A ``text/event-stream`` media type: events whose ``data`` is a chunk or an error (as
    JSON), the last one ``[DONE]``."""
    data = {"type": "string", "description": "A JSON chunk; an error event ends a stream "
            "that fails after it started; the last event is [DONE].",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [chunk, error]}}}
    return {"itemSchema": {"type": "object", "required": ["data"],
                           "properties": {"data": data, "event": {"type": "string"}}}}


def build_openapi(routes: list[Route], app: web.Application, *, version: str,
                  secured: bool, limits: SamplingLimits | None = None,
                  served: Served | None = None, engine: Any = None) -> dict[str, Any]:
    """The document for ``routes`` (those ``enabled`` for ``engine``) plus any other route
    found on ``app`` (added by plugins).
    ``limits``: the served engine's (``--max-n``, ``--max-logprobs``, its vocabulary);
    ``served``: its model names and context length."""
    switched_off = [r for r in routes if r.enabled is not None and not r.enabled(engine)]
    routes = [r for r in routes if r not in switched_off]
    types: list[type] = [ErrorResponse]
    for r in routes:
        types += [t for t in (r.body, r.response, r.stream, r.error, r.query)
                  if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, schemas, strict=True))
    limits = limits or SamplingLimits()
    queries: dict[type, dict[str, Any]] = {}  # parameters, not bodies: inlined
    for q in {r.query for r in routes if r.query is not None}:
        queries[q] = components.pop(ref[q]["$ref"].rsplit("/", 1)[1])
    for body in {r.body for r in routes if r.body is not None}:  # what the server enforces
        schema = components[ref[body]["$ref"].rsplit("/", 1)[1]]
        publish_bounds(schema, limits)
        publish_served(body, schema, limits, served or Served(), components)
    if image_encoder(engine) is None:  # a text-only model: no image parts
        drop_image_parts(components)
    error = {"description": "An error in OpenAI's shape",
             "content": {"application/json": {"schema": ref[ErrorResponse]}}}
    unavailable = {"description": "Overloaded (--max-queued-requests) or shutting down: retry "
                   "after Retry-After seconds",
                   "headers": {"Retry-After": {"required": True, "description": "seconds",
                                               "schema": {"type": "integer", "minimum": 0}}},
                   "content": error["content"]}
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        route_error, route_unavailable, error_ref = error, unavailable, ref[ErrorResponse]
        if r.error is not None:  # Anthropic's routes
            error_ref = ref[r.error]
            route_error = {"description": "An error in Anthropic's shape",
                           "content": {"application/json": {"schema": error_ref}}}
            route_unavailable = {**unavailable, "content": route_error["content"]}
        content: dict[str, Any] = {}
        if r.content_type is not None:
            kind = "object" if r.content_type == "application/json" else "string"
            schema = ref[r.response] if r.response is not None else {"type": kind}
            content[r.content_type] = {"schema": schema}
        if r.stream is not None:
            content["text/event-stream"] = _event_stream(ref[r.stream], error_ref)
        ok: dict[str, Any] = {"description": "OK"}
        if content:
            ok["content"] = content
        responses: dict[str, Any] = {"200": ok}
        if r.path not in NEVER_UNAVAILABLE:
            responses["503"] = route_unavailable
        responses["default"] = route_error
        op: dict[str, Any] = {
            "summary": r.summary,
            "operationId": r.handler.__name__,
            "responses": responses,
        }
        if r.body is not None:
            op["requestBody"] = {"required": True,
                                 "content": {r.body_type: {"schema": ref[r.body]}}}
        params = [{"name": p, "in": "path", "required": True, "schema": _path_schema(p, served)}
                  for p in _PATH_PARAM.findall(r.path)]
        if r.query is not None:
            params += [{"name": name, "in": "query", "required": False, "schema": schema}
                       for name, schema in queries[r.query].get("properties", {}).items()]
        if params:
            op["parameters"] = params
        if secured and r.path not in PUBLIC_PATHS:
            op["security"] = [{"bearerAuth": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    known = {(r.method, r.path) for r in routes} | {(r.method, r.path) for r in switched_off}
    for resource in app.router.resources():
        path = resource.canonical
        for route in resource:
            method = route.method
            # OPTIONS: CORS preflights (aiohttp-cors answers them), not operations.
            if method in ("HEAD", "OPTIONS", "*") or (method, path) in known:
                continue
            if getattr(route.handler, "openapi_hidden", False):  # the chat page (web.py)
                continue
            paths.setdefault(path, {})[method.lower()] = {
                "summary": "Added by a plugin",
                "responses": {"200": {"description": "OK"}, "default": error}}
    doc: dict[str, Any] = {
        "openapi": "3.2.0",
        "info": {"title": "asyncengine OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http",
                                                               "scheme": "bearer"}}
    return doc


def _path_schema(name: str, served: Served | None) -> dict[str, Any]:
    if name == "model" and served is not None and served.models:
        return {"type": "string", "enum": list(served.models)}
    return {"type": "string"}


def _embedding_size(engine: Any) -> int | None:
    try:
        from asyncengine.engine.embedding import embedding_size

        return embedding_size(engine)
    except Exception:  # an engine that cannot embed (a test's fake)
        return None


async def openapi_json(request: web.Request) -> web.Response:
    state = state_of(request)
    settings = state.settings
    from asyncengine.entrypoints.http.serving import lora_names

    served = Served((*state.served_model_names, *lora_names(state.engine)),
                    getattr(state.engine, "max_model_len", None), _embedding_size(state.engine),
                    auto_tool_choice=bool(getattr(settings, "enable_auto_tool_choice", False)
                                          and getattr(settings, "tool_call_parser", None)),
                    reasoning=bool(getattr(settings, "reasoning_parser", None)),
                    fim=_has_fim(state.engine))
    doc = build_openapi(request.app[ROUTES], request.app, version=package_version(),
                        secured=state.settings.api_key is not None,
                        limits=getattr(state.engine, "sampling_limits", None), served=served,
                        engine=state.engine)
    return web.json_response(doc)


def _has_fim(engine: Any) -> bool:
    from asyncengine.text.fim import tokenizer_fim_tokens

    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer is not None and tokenizer_fim_tokens(tokenizer) is not None
