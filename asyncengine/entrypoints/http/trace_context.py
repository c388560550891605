"""A request's W3C trace context (``traceparent``, ``tracestate``), for its span.

With ``--otlp-traces-endpoint`` the middleware puts the headers in :data:`current_trace_headers`
for the handler's task, and ``open_streams`` passes them to the engine (``trace_headers``),
whose span for the request becomes a child of the caller's (``engine/tracing.py``). Without
the flag the middleware is not installed and no header is read.
"""

from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web

from asyncengine.engine.tracing import trace_headers

#: The trace context of the HTTP request this task serves (None: none, or not traced).
current_trace_headers: ContextVar[dict[str, str] | None] = ContextVar(
    "asyncengine_trace_headers", default=None)


def tracing_enabled(engine: object) -> bool:
    config = getattr(engine, "config", None)
    observability = getattr(config, "observability", None)
    return getattr(observability, "otlp_traces_endpoint", None) is not None


@web.middleware
async def trace_context_middleware(request: web.Request, handler) -> web.StreamResponse:
    headers = trace_headers(request.headers)
    if headers is None:
        return await handler(request)
    token = current_trace_headers.set(headers)
    try:
        return await handler(request)
    finally:
        current_trace_headers.reset(token)
