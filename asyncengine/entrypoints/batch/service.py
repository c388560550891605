"""The Batch API's state in a server: the store and the runner, alive inside ``batch_jobs``.

``asyncengine serve`` enters ``batch_jobs(app)`` around the HTTP site: it opens
``--batch-dir`` (a temporary directory, removed at exit, when none is given), starts a task
for every batch a previous run left unfinished, and cancels the batches' tasks when the
server stops (lines in flight are not written, and run again at the next start).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
from aiohttp import web

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.batch.protocol import UNFINISHED
from asyncengine.entrypoints.batch.runner import Admission, BatchRunner, default_limit
from asyncengine.entrypoints.batch.store import BatchStore
from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.state import STATE, ServerState

logger = logging.getLogger("asyncengine.entrypoints.batch")


class BatchService:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None

    def running(self) -> tuple[BatchStore, BatchRunner]:
        if self.store is None or self.runner is None:
            raise APIError(503, "Batch jobs are not running on this server.")
        return self.store, self.runner


BATCHES = web.AppKey("asyncengine_batches", BatchService)


def batches_of(request: web.Request) -> tuple[BatchStore, BatchRunner]:
    return request.app[BATCHES].running()


class _AllModels:
    """What ``Admission`` sees of a router's engines: the requests of every loaded model."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def stats(self) -> SimpleNamespace:
        running = waiting = 0
        for entry in self.registry.entries.values():
            engine = entry.engine
            if engine is not None and entry.status == "loaded":
                stats = engine.stats()
                running, waiting = running + stats.num_running, waiting + stats.num_waiting
        return SimpleNamespace(num_running=running, num_waiting=waiting)


@asynccontextmanager
async def batch_jobs(app: web.Application, max_num_seqs: int | None = None) -> \
        AsyncIterator[BatchService]:
    """``max_num_seqs``: a router's (its engines' --max-num-seqs), for the default bound on
    lines in flight; a single-model server's engine says its own."""
    state = app[STATE]
    service = app[BATCHES]
    settings = state.settings
    engine = state.engine if state.registry is None else _AllModels(state.registry)
    temporary = None
    root = settings.batch_dir
    if root is None:
        root = temporary = await anyio.to_thread.run_sync(
            lambda: tempfile.mkdtemp(prefix="asyncengine-batches-"))
        logger.info("batch files in %s, removed at exit (--batch-dir keeps them, and resumes "
                    "unfinished batches after a restart)", root)
    store = await BatchStore.open(root, settings.max_batch_file_size)
    limit = settings.max_batch_concurrency or default_limit(
        max_num_seqs or (state.engine.config.scheduler.max_num_seqs if state.engine is not None
                         else EngineConfig().scheduler.max_num_seqs))
    admission = Admission(engine, limit, paused=lambda: state.draining)
    try:
        async with anyio.create_task_group() as tg:
            runner = BatchRunner(state, store, admission, tg)
            resumed = [r for r in store.batches.values() if r.batch.status in UNFINISHED]
            for record in resumed:
                runner.start(record)
            if resumed:
                logger.info("resuming %d unfinished batch(es) from %s", len(resumed), root)
            service.store, service.runner = store, runner
            try:
                yield service
            finally:
                service.store = service.runner = None
                tg.cancel_scope.cancel()
    finally:
        if temporary is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    lambda: shutil.rmtree(temporary, ignore_errors=True))
