"""The app on its address: what the single-model server and the router both do to listen."""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

from aiohttp import web

from asyncengine.entrypoints.http.state import ServerSettings

logger = logging.getLogger("asyncengine.entrypoints.http")

#: Seconds the HTTP handlers get to end once the server stops (after the drain).
HANDLER_GRACE_S = 5.0


@contextlib.asynccontextmanager
async def listening(app: web.Application, settings: ServerSettings,
                    tls: ssl.SSLContext | None) -> AsyncIterator[web.AppRunner | None]:
    """``app`` served on the settings' host and port until the block ends; None, with the
    reason logged, when it cannot listen there (the port is taken, say). At the end the
    handlers get up to ``HANDLER_GRACE_S`` seconds."""
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=HANDLER_GRACE_S,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, ssl_context=tls)
        try:
            await site.start()
        except OSError as e:
            logger.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
            yield None
            return
        yield runner
    finally:
        await runner.cleanup()
