"""Aborts of requests whose consumer left (a client gone, a task cancelled, ``break``).

A running request is finished at once: its blocks go back to the pool before the call
returns (an in-flight step that still writes them completes first; see the scheduler
contract). One still waiting holds no KV blocks, so it is finished a moment later, in batches
of ``ABORT_BATCH`` per loop iteration: a storm of aborts over a deep queue (10,000 clients
timing out together) never stalls the loop.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from asyncengine.core.request import Request, RequestStatus
from asyncengine.engine.output_processor import OutputProcessor

#: Aborts of waiting requests finished per loop iteration.
ABORT_BATCH = 256
_WAITING = RequestStatus.WAITING


class _Engine(Protocol):
    """What aborts use of the engine (``AsyncEngine``, which imports this module)."""

    outputs: OutputProcessor
    scheduler: Any

    @property
    def running(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def emit(self, requests: list[Request]) -> None: ...


class Aborts:
    """The engine's aborts: at once for running requests, batched for waiting ones."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self._backlog: dict[str, None] = {}  # waiting requests to finish, in order
        self._reap = anyio.Event()
        #: What the callers of the requests ``all`` aborted are told (None: the server is
        #: shutting down); a router names the model it unloads or puts to sleep.
        self.reason: str | None = None

    def reset(self) -> None:
        """Events belong to the event loop that runs the engine (see ``__aenter__``)."""
        self._reap = anyio.Event()
        self.reason = None

    def now(self, request_id: str) -> None:
        """Abort a request whose consumer left (a stream's ``on_abort``)."""
        engine = self.engine
        if engine is None:  # disposed of (cycles.py): its requests are gone with it
            return
        stream = engine.outputs.streams.get(request_id)
        if stream is None:
            return
        if engine.running and engine.error is None:
            for s in stream.samples:
                if s.request.status is not _WAITING:
                    break
            else:
                self._backlog[request_id] = None
                if len(self._backlog) == 1:
                    self._reap.set()
                return
        self.at_once(request_id)

    async def reap(self) -> None:
        """The task that finishes the backlog of waiting requests, a batch at a time."""
        while True:
            await self._reap.wait()
            self._reap = anyio.Event()
            while self._backlog:
                for rid in list(islice(self._backlog, ABORT_BATCH)):
                    del self._backlog[rid]
                    self.at_once(rid)
                await anyio.lowlevel.checkpoint()

    def at_once(self, request_id: str) -> None:
        engine = self.engine
        if engine is None:
            return
        stream = engine.outputs.streams.get(request_id)
        if stream is None:
            return
        ids = engine.outputs.unfinished_ids(request_id)
        engine.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        engine.emit([s.request for s in stream.samples if s.finish_reason is None])

    def all(self, reason: str | None = None) -> None:
        """Every request with a stream (the engine stops, or a drain timed out); ``reason``:
        what their callers are told, unless one was given before."""
        self.reason = self.reason or reason
        self._backlog.clear()
        for rid in list(self.engine.outputs.streams):
            self.at_once(rid)
