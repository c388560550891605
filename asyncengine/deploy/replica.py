"""EngineReplica: one ``AsyncEngine`` and its aiohttp OpenAI server inside a Ray Serve replica.

The replica runs exactly what ``asyncengine serve`` runs (``entrypoints/http/app.build_app``:
every route, the middlewares, the plugins' routes) on the replica's event loop, listening on a
Unix socket private to the replica. ``forward`` sends one HTTP request to it and streams the
response back to the ingress: the status and headers first, then the body chunks as they are
written (SSE events included). One implementation of the routes, at the cost of one local
socket hop per request.

The engine and the server live in one task started by ``__init__`` (anyio's task groups must
be left by the task that entered them); ``__del__``, Serve's shutdown hook, drains them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from asyncengine.entrypoints.cli import build_parser
from asyncengine.entrypoints.flags.engine import apply_yaml_defaults
from asyncengine.entrypoints.http.app import build_app
from asyncengine.entrypoints.http.server import make_metrics, settings_from_args
from asyncengine.entrypoints.http.state import STATE, ServerSettings

logger = logging.getLogger("asyncengine.deploy")

#: Request header that pins a request to one replica (id or index); also on every response,
#: naming the replica that answered.
REPLICA_HEADER = "X-AsyncEngine-Replica"
#: Headers that belong to one connection, never forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                        "host", "upgrade", "proxy-connection", "te", "trailer"})
#: Seconds to wait for the server to stop after the drain.
_STOP_GRACE_S = 10.0


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    """``asyncengine serve``'s flags (``--config`` YAML included) as the CLI parses them; a
    ``ValueError`` for bad ones."""
    parser = build_parser()
    full = ["serve", *argv]
    try:
        args = parser.parse_args(full)
    except SystemExit as e:  # argparse has printed the reason
        raise ValueError(f"bad asyncengine serve flags: {' '.join(argv)}") from e
    command = next(a for a in parser._actions
                   if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    args = apply_yaml_defaults(parser, command, full, args)
    if args.model_flag:
        if args.model and args.model != args.model_flag:
            raise ValueError(f"the model is given twice ({args.model!r} and --model "
                             f"{args.model_flag!r})")
        args.model = args.model_flag
    return args, EngineConfig.from_cli(args)


def check_deployable(settings: ServerSettings) -> None:
    if settings.ssl_certfile:
        raise ValueError("--ssl-certfile: TLS is not terminated by the replicas; configure it "
                         "on Ray Serve's proxy or a load balancer in front of it")
    if settings.root_path:
        raise ValueError("--root-path: set the route prefix of the Serve application instead")


class EngineReplica:
    """The user class of the engine deployment (see ``asyncengine.deploy.ray``)."""

    async def __init__(self, serve_argv: list[str]) -> None:
        from ray import serve

        args, config = parse_serve_args(serve_argv)
        settings = settings_from_args(args)
        check_deployable(settings)
        self.settings = settings
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(config)  # loads the model (blocking: nothing to serve yet)
        self.engine.metrics = make_metrics(self.engine)
        self._dir = tempfile.mkdtemp(prefix="asyncengine-replica-")
        self._socket = os.path.join(self._dir, "http.sock")
        self._stop = asyncio.Event()
        self._app: web.Application | None = None
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._serve(started))
        await started
        self._http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self._socket, limit=0),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        logger.info("replica %s serving %s", self.replica_id, self.engine.model_name)

    async def _serve(self, started: asyncio.Future[None]) -> None:
        try:
            async with self.engine:
                self._app = build_app(self.engine, self.engine.metrics, self.settings)
                runner = web.AppRunner(self._app, handler_cancellation=True,
                                       shutdown_timeout=_STOP_GRACE_S, access_log=None)
                await runner.setup()
                try:
                    await web.UnixSite(runner, self._socket).start()
                    started.set_result(None)
                    await self._stop.wait()
                    self._app[STATE].draining = True
                    await self.engine.drain(self.settings.shutdown_timeout)
                finally:
                    await runner.cleanup()
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            raise

    # -- called through the router ------------------------------------------------------------
    async def forward(self, method: str, path: str, headers: list[tuple[str, str]],
                      body: bytes, *, prefix: str = "",
                      replica: str | None = None) -> AsyncIterator[Any]:
        """Serve one HTTP request: yields ``(status, headers)``, then the body's chunks.
        ``prefix`` and ``replica`` are read by the router only."""
        async with self._http.request(method, "http://replica" + path, headers=headers,
                                      data=body or None, allow_redirects=False) as resp:
            out = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
            out.append((REPLICA_HEADER, self.replica_id))
            yield resp.status, out
            async for chunk in resp.content.iter_any():
                yield chunk

    # -- Serve's hooks ------------------------------------------------------------------------
    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics ``WaitingQueuePolicy`` scales on."""
        stats = self.engine.stats()
        return {"num_waiting": float(stats.num_waiting), "num_running": float(stats.num_running),
                "max_num_seqs": float(self.engine.config.scheduler.max_num_seqs)}

    async def check_health(self) -> None:
        """Serve replaces a replica whose engine failed (its step loop raised)."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.engine.error}")
        if self._task.done():
            raise RuntimeError("the replica's server has stopped")

    async def __del__(self) -> None:
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task),
                                   self.settings.shutdown_timeout + _STOP_GRACE_S)
        except Exception:
            logger.warning("replica %s did not stop cleanly", self.replica_id, exc_info=True)
        await self._http.close()
        shutil.rmtree(self._dir, ignore_errors=True)
