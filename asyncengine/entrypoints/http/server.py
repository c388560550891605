"""``asyncengine serve``: the engine and the aiohttp server in one event loop.

``serve`` enters the engine (its step loop joins the task graph), starts aiohttp on the same
loop and waits for SIGINT/SIGTERM. Then new requests get 503, in-flight ones have
``--shutdown-timeout`` seconds to finish (``engine.drain``), the rest are aborted, and the
process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import anyio
from aiohttp import web

from asyncengine.config import EngineConfig, parse_size
from asyncengine.entrypoints.http.state import DEFAULT_MAX_REQUEST_BODY, STATE, ServerSettings

logger = logging.getLogger("asyncengine.entrypoints.http")

API_KEY_ENV = "ASYNCENGINE_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# After the drain, how long aiohttp waits for handlers to write their last bytes.
_HANDLER_GRACE_S = 5.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from ``config.add_engine_args``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on "
                   f"every route but /health and /metrics (default: ${API_KEY_ENV})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGINT/SIGTERM, "
                   "seconds in-flight requests get to finish before they are aborted "
                   "(default: 30)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="log level (default: info)")
    g.add_argument("--max-request-body", default=None, help="largest request body, e.g. "
                   "16MiB; larger ones get 413 (default: 16MiB)")
    g.add_argument("--disable-access-log", action="store_true",
                   help="do not log one line per HTTP request")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    max_body = args.max_request_body
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout: must be non-negative, got {args.shutdown_timeout}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port: must be in 0..65535, got {args.port}")
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        shutdown_timeout=args.shutdown_timeout,
        max_request_body=(DEFAULT_MAX_REQUEST_BODY if max_body is None
                          else parse_size(max_body, "max_request_body")),
        access_log=not args.disable_access_log,
    )


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the server until SIGINT/SIGTERM; the exit status."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    return anyio.run(serve, config, settings)


async def serve(config: EngineConfig, settings: ServerSettings) -> int:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.metrics import EngineMetrics

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        engine = AsyncEngine(config)  # loads the model (blocking: nothing to serve yet)
        # The metrics are labelled with the served name, known once the model is loaded.
        metrics = engine.metrics = EngineMetrics(model_name=engine.model_name)
        async with engine:
            app = build_app(engine, metrics, settings)
            runner = web.AppRunner(
                app, handler_cancellation=True, shutdown_timeout=_HANDLER_GRACE_S,
                access_log=logging.getLogger("aiohttp.access") if settings.access_log else None)
            await runner.setup()
            try:
                site = web.TCPSite(runner, settings.host, settings.port)
                try:
                    await site.start()
                except OSError as e:  # e.g. the port is taken
                    logger.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
                    return 1
                for address in runner.addresses:
                    host, port = address[0], address[1]
                    logger.info("serving %s on http://%s:%s", engine.model_name,
                                f"[{host}]" if ":" in host else host, port)
                async for signum in signals:
                    logger.info("%s: draining (up to %ss)", signal.Signals(signum).name,
                                settings.shutdown_timeout)
                    break
                app[STATE].draining = True
                await _drain(engine, settings.shutdown_timeout, signals)
            finally:
                await runner.cleanup()
    logger.info("stopped")
    return 0


async def _drain(engine, timeout: float, signals) -> None:
    """``engine.drain(timeout)``, cut short by another signal."""
    async with anyio.create_task_group() as tg:

        async def second_signal() -> None:
            async for signum in signals:
                logger.info("%s again: aborting in-flight requests",
                            signal.Signals(signum).name)
                tg.cancel_scope.cancel()
                return

        tg.start_soon(second_signal)
        await engine.drain(timeout)
        tg.cancel_scope.cancel()
    await engine.drain(0)  # when cut short: abort what is left now
