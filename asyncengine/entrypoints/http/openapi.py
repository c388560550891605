"""GET /openapi.json: an OpenAPI 3.1 document of every route, its body and its responses.

The schemas are generated from the msgspec Structs the handlers decode and encode, so the
document cannot drift from what the server accepts.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.entrypoints.http.auth import PUBLIC_PATHS
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
    content_type: str = "application/json"


ROUTES = web.AppKey("asyncengine_routes", list)
_PATH_PARAM = re.compile(r"{(\w+)}")


def build_openapi(routes: list[Route], app: web.Application, *, version: str,
                  secured: bool) -> dict[str, Any]:
    """The document for ``routes`` plus any other route found on ``app`` (added by plugins)."""
    types: list[type] = [ErrorResponse]
    for r in routes:
        types += [t for t in (r.body, r.response, r.stream) if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, schemas, strict=True))
    error = {"description": "An error in OpenAI's shape",
             "content": {"application/json": {"schema": ref[ErrorResponse]}}}
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        content: dict[str, Any] = {}
        if r.response is not None:
            content[r.content_type] = {"schema": ref[r.response]}
        else:
            content[r.content_type] = {"schema": {"type": "string"}}
        if r.stream is not None:
            content["text/event-stream"] = {
                "schema": {"type": "string", "description": "With \"stream\": true: events "
                           "'data: <chunk>', then 'data: [DONE]'."},
                "x-event-data": ref[r.stream]}
        op: dict[str, Any] = {
            "summary": r.summary,
            "operationId": r.handler.__name__,
            "responses": {"200": {"description": "OK", "content": content}, "default": error},
        }
        if r.body is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": ref[r.body]}}}
        params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                  for p in _PATH_PARAM.findall(r.path)]
        if params:
            op["parameters"] = params
        if secured and r.path not in PUBLIC_PATHS:
            op["security"] = [{"bearerAuth": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    known = {(r.method, r.path) for r in routes}
    for resource in app.router.resources():
        path = resource.canonical
        for route in resource:
            method = route.method
            if method in ("HEAD", "*") or (method, path) in known:
                continue
            paths.setdefault(path, {})[method.lower()] = {
                "summary": "Added by a plugin", "responses": {"200": {"description": "OK"}}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "asyncengine OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http",
                                                               "scheme": "bearer"}}
    return doc


async def openapi_json(request: web.Request) -> web.Response:
    state = state_of(request)
    doc = build_openapi(request.app[ROUTES], request.app, version=package_version(),
                        secured=state.settings.api_key is not None)
    return web.json_response(doc)
