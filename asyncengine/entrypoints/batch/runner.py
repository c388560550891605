"""Running batches: one task per unfinished batch, in the server's task group.

A batch's task reads its input file a chunk of lines at a time (off the loop), skips the
lines its journals already hold (a restart resumes it), and starts each other line as a task
once ``Admission`` lets it. A finished line is appended to the output or error journal in
one write, and only then counted. When every line is written the journals are copied, in
the input's order, into the output and error files, which become the batch's
``output_file_id`` and ``error_file_id``; the batch is ``completed``.

Cancelling aborts the lines in flight (their engine requests with them) and ends the batch
as ``cancelled``, with the lines already done as its output. A batch still running 24 hours
after its creation ends as ``expired``; its remaining lines get ``batch_expired`` errors. When
the server drains, no line starts; lines the drain aborts are not written, and run again
after the restart.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskGroup

from asyncengine.entrypoints.batch import journal
from asyncengine.entrypoints.batch.lines import Retry, execute, line_id
from asyncengine.entrypoints.batch.protocol import (
    BatchError,
    BatchErrors,
    BatchRecord,
    InputLine,
    LineError,
    OutputLine,
)
from asyncengine.entrypoints.batch.store import BatchStore
from asyncengine.entrypoints.http.state import ServerState
from asyncengine.entrypoints.http.tenancy import current_tenant

logger = logging.getLogger("asyncengine.entrypoints.batch")

_ENCODE = msgspec.json.Encoder()
#: Lines read from an input file at a time.
READ_CHUNK = 64
#: Seconds between two tries of a line the engine could not take (overloaded).
RETRY_S = 0.5
#: Seconds after the engine last held an interactive request before a batch line starts.
INTERACTIVE_GRACE_S = 1.0


class Admission:
    """Which batch lines may start now: at most ``limit`` in flight over all batches, none
    while ``paused()`` (the server drains), and, with ``yield_to_interactive``, none while
    the engine holds a request that is not a batch line's, nor for ``grace_s`` after it last
    did (a user's next request tends to follow the last one).

    The default scheduler (``fcfs``) admits in arrival order and ignores priorities, and a
    step in flight is never interrupted: an interactive request waits for the step running
    and the one queued behind it. A batch line's prefill is a long step, so while
    interactive traffic lasts no line starts (no prefill of the batch's own); the lines
    already running go on decoding, a few rows of each step."""

    def __init__(self, engine: Any, limit: int, *, yield_to_interactive: bool = True,
                 paused: Callable[[], bool] = lambda: False, poll_s: float = 0.01,
                 grace_s: float = INTERACTIVE_GRACE_S) -> None:
        self.engine = engine
        self.limit = max(1, limit)
        self.yield_to_interactive = yield_to_interactive
        self.paused = paused
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.in_flight = 0  # admitted, not yet released
        self.in_engine = 0  # of which are between starting and ending their engine requests
        self._interactive_at = -math.inf
        self._freed = anyio.Event()

    def _interactive(self) -> bool:
        now = time.monotonic()
        stats = self.engine.stats()
        # Every engine request of a batch line is counted by in_engine: more are not ours.
        if stats.num_running + stats.num_waiting > self.in_engine:
            self._interactive_at = now
        return now - self._interactive_at < self.grace_s

    def _may_start(self) -> bool:
        if self.in_flight >= self.limit or self.paused():
            return False
        return not self.yield_to_interactive or not self._interactive()

    async def acquire(self) -> None:
        while not self._may_start():
            with anyio.move_on_after(self.poll_s):
                await self._freed.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._freed.set()
        self._freed = anyio.Event()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a line's engine requests."""
        self.in_engine += 1
        try:
            yield
        finally:
            self.in_engine -= 1


class _Journals:
    """A running batch's two journals, each written by one line at a time."""

    def __init__(self, output: journal.Journal, errors: journal.Journal) -> None:
        self.files = {False: output, True: errors}
        self.locks = {False: anyio.Lock(), True: anyio.Lock()}

    async def append(self, line: OutputLine) -> None:
        failed = line.error is not None
        async with self.locks[failed]:
            await anyio.to_thread.run_sync(self.files[failed].append,
                                           _ENCODE.encode(line) + b"\n")

    def close(self) -> None:
        for f in self.files.values():
            f.close()


class BatchRunner:
    def __init__(self, state: ServerState, store: BatchStore, admission: Admission,
                 task_group: TaskGroup) -> None:
        self.state = state
        self.store = store
        self.admission = admission
        self.task_group = task_group
        self._scopes: dict[str, anyio.CancelScope] = {}

    def stopping(self) -> bool:
        engine = self.state.engine  # (None in router mode: each model fails alone)
        return self.state.draining or engine is not None and engine.error is not None

    def start(self, record: BatchRecord) -> None:
        self.task_group.start_soon(self._run, record, name=f"batch {record.batch.id}")

    async def cancel(self, record: BatchRecord) -> None:
        b = record.batch
        b.status, b.cancelling_at = "cancelling", int(time.time())
        scope = self._scopes.get(b.id)
        if scope is not None:
            scope.cancel()
        await self.store.save(record)

    async def _run(self, record: BatchRecord) -> None:
        b = record.batch
        current_tenant.set(record.tenant)
        try:
            ending = None
            with anyio.CancelScope() as scope:
                self._scopes[b.id] = scope
                try:
                    if b.status != "cancelling":
                        ending = await self._execute(record)
                finally:
                    del self._scopes[b.id]
            if b.status == "cancelling":
                await self._finish(record, "cancelled")
            elif ending is not None:
                await self._finish(record, ending)
        except Exception as e:
            logger.exception("batch %s failed", b.id)
            b.status, b.failed_at = "failed", int(time.time())
            b.errors = BatchErrors(data=[BatchError(code="server_error", message=str(e))])
            await self.store.save(record)

    async def _execute(self, record: BatchRecord) -> str | None:
        """Run the lines not written yet; how the batch ends (``completed``, ``expired``), or
        None when lines are left (the server stops)."""
        b = record.batch
        paths = [self.store.journal_path(b.id, k) for k in ("output", "errors")]
        written = [await anyio.to_thread.run_sync(journal.recover, p) for p in paths]
        b.request_counts.completed, b.request_counts.failed = map(len, written)
        skip = set(written[0]) | set(written[1])
        files = [await anyio.to_thread.run_sync(journal.Journal, p) for p in paths]
        journals = _Journals(*files)
        expired = False
        try:
            async with anyio.create_task_group() as tg:
                offset = 0
                while True:
                    lines, offset = await self.store.read_lines(b.input_file_id, offset,
                                                                READ_CHUNK)
                    if not lines:
                        break
                    for line in lines:
                        if line.custom_id in skip:
                            continue
                        if _expired(record):
                            expired = True
                            await self._write(record, journals, _expired_line(line))
                            continue
                        await self.admission.acquire()
                        tg.start_soon(self._line, record, journals, line)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(journals.close)
        counts = b.request_counts
        if counts.completed + counts.failed < counts.total:
            return None
        return "expired" if expired else "completed"

    async def _line(self, record: BatchRecord, journals: _Journals, line: InputLine) -> None:
        try:
            while True:
                try:
                    with self.admission.running():
                        out = await execute(self.state, line)
                    break
                except Retry:
                    if self.stopping():
                        return  # not written: it runs after the restart
                    await anyio.sleep(RETRY_S)
            await self._write(record, journals, out)
        finally:
            self.admission.release()

    async def _write(self, record: BatchRecord, journals: _Journals, out: OutputLine) -> None:
        await journals.append(out)
        counts = record.batch.request_counts
        if out.error is None:
            counts.completed += 1
        else:
            counts.failed += 1

    async def _finish(self, record: BatchRecord, status: str) -> None:
        """Copy the journals, in the input's order, into the output and error files."""
        b = record.batch
        now = int(time.time())
        paths = [self.store.journal_path(b.id, k) for k in ("output", "errors")]
        written = [set(await anyio.to_thread.run_sync(journal.recover, p)) for p in paths]
        b.request_counts.completed, b.request_counts.failed = map(len, written)
        if status != "cancelled":
            b.status, b.finalizing_at = "finalizing", now
            await self.store.save(record)
        source = self.store.content_path(b.input_file_id)
        for kind, file_id, path, lines in zip(("output", "errors"), (
                record.output_file_id, record.error_file_id), paths, written, strict=True):
            if kind == "errors" and not lines:
                continue
            size = await anyio.to_thread.run_sync(
                journal.write_ordered_file, source, [path], self.store.content_path(file_id))
            name = f"{b.id}_{'output' if kind == 'output' else 'error'}.jsonl"
            await self.store.add_file(None, name, "batch_output", size, file_id)
            if kind == "output":
                b.output_file_id = file_id
            else:
                b.error_file_id = file_id
        b.status = status  # type: ignore[assignment]
        setattr(b, f"{status}_at", int(time.time()))
        await self.store.save(record)
        await self.store.remove_journals(b.id)
        logger.info("batch %s %s: %d lines done, %d failed", b.id, status,
                    b.request_counts.completed, b.request_counts.failed)


def _expired(record: BatchRecord) -> bool:
    expires = record.batch.expires_at
    return expires is not None and time.time() > expires


def _expired_line(line: InputLine) -> OutputLine:
    return OutputLine(id=line_id(), custom_id=line.custom_id, response=None,
                      error=LineError(code="batch_expired", message="This request could not "
                                      "be executed before the completion window expired."))


def default_limit(max_num_seqs: int) -> int:
    """Lines in flight at most, over all batches, unless --max-batch-concurrency says."""
    return max(1, math.ceil(max_num_seqs / 8))
