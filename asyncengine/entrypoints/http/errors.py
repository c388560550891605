"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; the error middleware turns it (and aiohttp's own HTTP errors:
unknown route, wrong method, oversized body) into a JSON response. Anything else is logged
with its traceback and answered with a bare 500: the client never sees a traceback.

Anthropic's routes (``/v1/messages``...) answer in Anthropic's shape instead:
``{"type": "error", "error": {"type", "message"}}`` (``ANTHROPIC_PATHS``).

Every 503 carries ``Retry-After`` (seconds): the official openai client honours it when it
retries on its own.
"""

from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

from asyncengine.entrypoints.http.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger("asyncengine.entrypoints.http")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

#: ``Retry-After`` of a 503 when the queue is full: a slot opens whenever a request finishes.
OVERLOADED_RETRY_AFTER_S = 1
#: ``Retry-After`` of a 503 while the server shuts down (or restarts after an engine failure).
SHUTDOWN_RETRY_AFTER_S = 5


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None, type: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        if retry_after is None and status == 503:
            retry_after = SHUTDOWN_RETRY_AFTER_S
        self.retry_after = retry_after

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": anthropic_type(self.status),
                                           "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        body = self.anthropic_body() if anthropic else self.body()
        return web.Response(status=self.status, body=msgspec.json.encode(body),
                            content_type="application/json", headers=headers)


#: Routes whose errors take Anthropic's shape (also under --root-path).
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else
                                "api_error")


def is_anthropic(request: web.Request) -> bool:
    return request.path.rstrip("/").endswith(ANTHROPIC_PATHS)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_AT = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
# msgspec's messages for the ranges the request types carry (``protocol.Int64`` and others).
_BOUND = re.compile(r"Expected `(int|float)` (>=|<=|>|<) (-?[0-9.e+]+)")
_BOUND_WORDS = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}
_NOT_EMPTY = re.compile(r"Expected `(str|array|object)` of length >= 1")


def from_decode_error(error: msgspec.DecodeError) -> APIError:
    """A 400 for a body msgspec rejected: malformed JSON, a wrong type, an unknown field."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return bad_request(f"The request body is not valid JSON: {text}")
    at = _AT.search(text)
    path = at.group(1) if at else ""
    unknown = _UNKNOWN.search(text)
    if unknown:
        name = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return bad_request(f"Unsupported parameter: '{name}' is not supported by this server.",
                           param=name)
    bound = _BOUND.match(text)
    if bound and path:
        return bad_request(f"{path} must be {_BOUND_WORDS[bound.group(2)]} {bound.group(3)}"
                           + (" (it must fit in 64 bits)" if len(bound.group(3)) >= 19 else ""),
                           param=path)
    if _NOT_EMPTY.match(text) and path:
        return bad_request(f"{path} must not be empty", param=path)
    return bad_request(f"Invalid request: {text}", param=path or None)


_PARAM_WORD = re.compile(r"^([a-z_]+)\b")


def from_value_error(error: ValueError, known: set[str] | frozenset[str] = frozenset()) -> APIError:
    """A 400 for a ValueError from validation (SamplingParams, the engine's add_request);
    ``param`` is set when the message starts with the name of a known parameter."""
    message = str(error)
    word = _PARAM_WORD.match(message)
    param = word.group(1) if word and word.group(1) in known else None
    return bad_request(message, param=param)


def from_http_exception(request: web.Request, exc: web.HTTPException) -> APIError:
    """aiohttp's own errors (routing, body size) in OpenAI's shape."""
    status = exc.status
    headers = None
    if status == 404:
        message = f"Not found: {request.method} {request.path}"
    elif status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"Method {request.method} is not allowed for {request.path} (allowed: " \
                  f"{allowed})"
        headers = {"Allow": allowed}  # RFC 9110: a 405 lists the allowed methods
    elif status == 413:
        message = f"The request body is too large: {exc.text}"
    else:
        message = exc.text or exc.reason
    return APIError(status, message, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return e.response(is_anthropic(request))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return from_http_exception(request, e).response(is_anthropic(request))
    except Exception:
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return APIError(500, "Internal server error (see the server log).").response(
            is_anthropic(request))
