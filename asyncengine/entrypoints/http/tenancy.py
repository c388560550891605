"""Who a request is accounted to: its tenant, for schedulers that share capacity fairly.

The tenant is the ``X-Tenant`` header when sent and trusted (as a gateway in front of the server
would set it), else derived from the bearer token (``key-`` and 16 hex digits of its sha256, so
the key itself never reaches a scheduler, a log or a metric label), else None (the default
tenant). The header is trusted when the server has no ``--api-key`` (every client is trusted
then), and with ``--api-key`` only under ``--trust-tenant-header``: otherwise any holder of the
key could name another tenant and take its share; the header is ignored then.
The middleware puts it in :data:`current_tenant` for the handler's task; ``open_streams``
passes it to ``AsyncEngine.add_request(tenant=...)`` and so to ``Request.tenant``.
"""

from __future__ import annotations

import hashlib
import re
from contextvars import ContextVar

from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError

TENANT_HEADER = "X-Tenant"
_VALID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")

#: The tenant of the HTTP request this task serves (None: the default tenant).
current_tenant: ContextVar[str | None] = ContextVar("asyncengine_tenant", default=None)


def tenant_of(request: web.Request, trust_header: bool = True) -> str | None:
    """The request's tenant; a malformed ``X-Tenant`` is a 400 (when the header is trusted)."""
    named = request.headers.get(TENANT_HEADER) if trust_header else None
    if named is not None:
        named = named.strip()
        if not _VALID.match(named):
            raise APIError(400, f"{TENANT_HEADER}: 1 to 128 characters among letters, digits "
                                "and . _ : @ / -", param=TENANT_HEADER)
        return named
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    return None


def make_tenant_middleware(trust_header: bool):
    """The middleware setting :data:`current_tenant`; ``trust_header``: take ``X-Tenant``."""

    @web.middleware
    async def tenant(request: web.Request, handler) -> web.StreamResponse:
        token = current_tenant.set(tenant_of(request, trust_header))
        try:
            return await handler(request)
        finally:
            current_tenant.reset(token)

    return tenant

