"""API-key authentication (``--api-key``, ``$ASYNCENGINE_API_KEY`` or ``$VLLM_API_KEY``): sent as
``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's)."""

from __future__ import annotations

import hmac

from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.state import STATE
from asyncengine.entrypoints.http.web import is_web_path

#: Routes that answer without a key: probes and scrapers carry no credentials. The chat page
#: and its files (web.py's ``is_web_path``) need none either: the page asks for the key.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/ping"})


def auth_middleware(api_key: str):
    """A middleware that answers 401 unless ``Authorization: Bearer <api_key>`` or
    ``x-api-key: <api_key>`` is sent.

    The comparison is constant-time (``hmac.compare_digest`` over bytes) so response timing
    does not reveal how much of a guessed key was right.
    """
    expected = api_key.encode()

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        # CORS preflights carry no credentials (the request they announce will).
        if request.method != "OPTIONS" and not _public(request):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            bearer = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), expected)
            x_key = request.headers.get("x-api-key")
            if not bearer and not (x_key is not None and hmac.compare_digest(
                    x_key.strip().encode(), expected)):
                raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                    "<key>' (or 'x-api-key: <key>').", code="invalid_api_key")
        return await handler(request)

    return middleware


def _public(request: web.Request) -> bool:
    path = request.path
    if path in PUBLIC_PATHS or is_web_path(path):
        return True
    root = request.app[STATE].settings.root_path
    if not root or not path.startswith(root):
        return False
    rest = path[len(root):]
    return rest in PUBLIC_PATHS or is_web_path(rest)
