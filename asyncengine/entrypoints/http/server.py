"""``asyncengine serve``: the engine and the aiohttp server in one event loop.

``serve`` enters the engine (its step loop joins the task graph), starts aiohttp on the same
loop and waits for SIGINT/SIGTERM. Then new requests get 503, in-flight ones have
``--shutdown-timeout`` seconds to finish (``engine.drain``), the rest are aborted, and the
process exits 0. A second signal skips the wait.

If the engine fails (its step loop raised: a broken device), every in-flight request has
already been failed; the server stops accepting, gives the handlers a moment to write those
errors, and exits with ``ENGINE_FAILED_EXIT``, so that a supervisor restarts it. A live
process never answers 503 for good.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import ssl
from typing import TYPE_CHECKING

import anyio
from aiohttp.http_exceptions import HttpProcessingError

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.flags.router import router_settings
from asyncengine.entrypoints.flags.server import (  # noqa: F401 (the CLI imports them from here)
    API_KEY_ENV,
    add_serve_arguments,
    settings_from_args,
)
from asyncengine.entrypoints.http.listen import listening
from asyncengine.entrypoints.http.state import STATE, ServerSettings

if TYPE_CHECKING:
    from asyncengine.engine.metrics import EngineMetrics

logger = logging.getLogger("asyncengine.entrypoints.http")

# After the drain, how long aiohttp waits for handlers to write their last bytes.
_HTTP_LOGGERS = ("aiohttp.access", "aiohttp.server", "aiohttp.web", "aiohttp.internal")
#: The exit status of ``serve`` after an engine failure.
ENGINE_FAILED_EXIT = 1


class _OneLineParserErrors(logging.Filter):
    """aiohttp logs a request it cannot parse (a malformed request line, a bad header) with
    a traceback; anyone can send one, so make it one warning line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message or type(exc).__name__).split())
            if len(detail) > 200:
                detail = detail[:197] + "..."
            record.msg = f"{record.getMessage()}: {exc.code} {detail}"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_PARSER_ERRORS = _OneLineParserErrors()


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the server until SIGINT/SIGTERM or an engine failure; the exit status."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.uvicorn_log_level:
        level = "DEBUG" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level.upper()
        for name in _HTTP_LOGGERS:
            logging.getLogger(name).setLevel(level)
    settings = settings_from_args(args)  # ValueError: the CLI reports it, naming the flag
    logging.getLogger("asyncengine.requests").setLevel(
        logging.INFO if settings.log_requests else logging.WARNING)
    if config.model.trust_remote_code:
        logger.info("--trust-remote-code: accepted; the model code here is asyncengine's own, "
                    "so no code from the model repository runs")
    rs = router_settings(args)  # --models-dir, sleep mode: several engines, one loop
    if rs is not None:
        from asyncengine.entrypoints.http.router_server import catalog, serve_router

        settings.models_dir, settings.sleep_mode = rs.models_dir, rs.sleep_mode
        return anyio.run(serve_router, config, settings, rs, catalog(config, rs),
                         ssl_context(settings), make_metrics)
    return anyio.run(serve, config, settings)


def ssl_context(settings: ServerSettings) -> ssl.SSLContext | None:
    """TLS from --ssl-certfile/--ssl-keyfile (and client certificates from --ssl-ca-certs)."""
    if not settings.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
        if settings.ssl_ca_certs:
            ctx.load_verify_locations(settings.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load them: {e}") from None
    ctx.verify_mode = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)[
        settings.ssl_cert_reqs]
    return ctx


def make_metrics(engine) -> EngineMetrics:
    """The engine's metrics, labelled with the (first) served name, known once it is loaded."""
    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.executor.build import backend_names

    runner = getattr(engine, "runner", None)
    return EngineMetrics(model_name=engine.model_name, max_model_len=engine.max_model_len,
                         cache_config=engine.config.cache,
                         num_gpu_blocks=engine.num_total_blocks,
                         backends=backend_names(runner) if runner is not None else None)


async def serve(config: EngineConfig, settings: ServerSettings) -> int:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.gc_policy import tune_for_serving
    from asyncengine.entrypoints.batch.service import batch_jobs
    from asyncengine.entrypoints.http.app import build_app

    tls = ssl_context(settings)
    server_log = logging.getLogger("aiohttp.server")
    if _PARSER_ERRORS not in server_log.filters:
        server_log.addFilter(_PARSER_ERRORS)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        engine = AsyncEngine(config)  # loads the model (blocking: nothing to serve yet)
        metrics = engine.metrics = make_metrics(engine)
        async with engine, contextlib.AsyncExitStack() as jobs:
            app = build_app(engine, metrics, settings)
            # Batch jobs: tasks of this graph, unfinished ones resumed; cancelled after the
            # drain and the HTTP cleanup below.
            await jobs.enter_async_context(batch_jobs(app))
            async with listening(app, settings, tls) as runner:  # handlers: HANDLER_GRACE_S
                if runner is None:
                    return 1
                tune_for_serving()  # engine/gc_policy.py
                for address in runner.addresses:
                    host, port = address[0], address[1]
                    logger.info("serving %s on %s://%s:%s%s", engine.model_name,
                                "https" if tls else "http",
                                f"[{host}]" if ":" in host else host, port, settings.root_path)
                failure = await _signal_or_failure(engine, signals)
                app[STATE].draining = True
                if failure is None:
                    logger.info("draining (up to %ss)", settings.shutdown_timeout)
                    await _drain(engine, settings.shutdown_timeout, signals)
    if engine.error is not None:  # also when it failed during a drain
        logger.error("stopped after an engine failure (%s); exiting with status %d so that a "
                     "supervisor restarts the server", engine.error, ENGINE_FAILED_EXIT)
        return ENGINE_FAILED_EXIT
    logger.info("stopped")
    return 0


async def _signal_or_failure(engine, signals) -> BaseException | None:
    """Wait for SIGINT/SIGTERM (None) or for the engine to fail (the failure)."""
    failure: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            async for signum in signals:
                logger.info("%s received", signal.Signals(signum).name)
                break
            tg.cancel_scope.cancel()

        async def on_failure() -> None:
            nonlocal failure
            failure = await engine.wait_failed()
            tg.cancel_scope.cancel()

        tg.start_soon(on_signal)
        tg.start_soon(on_failure)
    return failure


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
