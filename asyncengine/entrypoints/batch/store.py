"""``--batch-dir``: the files and the batches, on disk and indexed in memory.

```
DIR/files/file-ID.jsonl            a file's content (uploaded, or a batch's output or errors)
DIR/files/file-ID.json             its FileObject: written last, so a file exists once whole
DIR/batches/batch_ID.json          its BatchRecord, replaced whole at each change of status
DIR/batches/batch_ID.output.jsonl  its finished lines while it runs (journal.py), and
DIR/batches/batch_ID.errors.jsonl    those that failed
```

Every read and write of the disk runs in a worker thread; uploads are streamed to disk, a
chunk at a time, and refused past ``--max-batch-file-size``. The loop owns the index (no
locks but one per batch record, which keeps its writes in order).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from asyncengine.entrypoints.batch import journal
from asyncengine.entrypoints.batch.journal import BadInput
from asyncengine.entrypoints.batch.protocol import (
    UNFINISHED,
    BatchRecord,
    FileObject,
    InputLine,
)

_FILE = msgspec.json.Decoder(FileObject)
_RECORD = msgspec.json.Decoder(BatchRecord)
_ENCODE = msgspec.json.Encoder()
#: Bytes gathered from an upload before each write.
_WRITE_CHUNK = 1 << 20


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, root: Path, max_file_size: int) -> None:
        self.root = root
        self.max_file_size = max_file_size
        self.files: dict[str, FileObject] = {}
        self.batches: dict[str, BatchRecord] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._scans: dict[tuple[str, str | None], int] = {}

    @classmethod
    async def open(cls, root: str | Path, max_file_size: int) -> BatchStore:
        store = cls(Path(root), max_file_size)
        await anyio.to_thread.run_sync(store._load)
        return store

    def _load(self) -> None:
        for sub in ("files", "batches"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            journal.remove_leftovers(self.root / sub)
        files = [_FILE.decode(p.read_bytes()) for p in (self.root / "files").glob("*.json")]
        for f in sorted(files, key=lambda f: f.created_at):
            if self.content_path(f.id).exists():
                self.files[f.id] = f
        records = [_RECORD.decode(p.read_bytes()) for p in (self.root / "batches").glob("*.json")]
        for r in sorted(records, key=lambda r: r.created_ns):
            self.batches[r.batch.id] = r

    # -- paths --------------------------------------------------------------------------------
    def content_path(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.jsonl"

    def _meta_path(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.json"

    def journal_path(self, batch_id: str, kind: str) -> Path:
        return self.root / "batches" / f"{batch_id}.{kind}.jsonl"

    # -- files --------------------------------------------------------------------------------
    async def receive(self, chunks: AsyncIterator[bytes], filename: str) -> tuple[str, int]:
        """Stream an upload to a temporary file: its path and size. ``BadInput`` (413) past
        ``max_file_size``, the partial file removed."""
        tmp = journal.temp_path(self.root / "files" / "upload")
        size = 0
        buffered = bytearray()
        f = await anyio.open_file(tmp, "wb")
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_file_size:
                    raise BadInput(f"The file {filename!r} is larger than this server takes "
                                   f"(--max-batch-file-size: {self.max_file_size} bytes).",
                                   code="file_too_large", param="file", status=413)
                buffered += chunk
                if len(buffered) >= _WRITE_CHUNK:
                    await f.write(bytes(buffered))
                    buffered.clear()
            await f.write(bytes(buffered))
            await f.flush()
            await anyio.to_thread.run_sync(_fsync, f.wrapped)
        except BaseException:
            with anyio.CancelScope(shield=True):  # a client gone: still no partial file
                await f.aclose()
                await anyio.to_thread.run_sync(lambda: tmp.unlink(missing_ok=True))
            raise
        await f.aclose()
        return str(tmp), size

    async def add_file(self, source: str | Path | None, filename: str, purpose: Any,
                       size: int, file_id: str | None = None) -> FileObject:
        """Make ``source`` (moved into place) the content of a file, and the file visible.
        ``source`` None: the content is in place already (a batch's output)."""
        file_id = file_id or new_id("file-")
        obj = FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                         filename=filename, purpose=purpose)

        def write() -> None:
            if source is not None:
                Path(source).replace(self.content_path(file_id))
            journal.write_atomic(self._meta_path(file_id), _ENCODE.encode(obj))

        await anyio.to_thread.run_sync(write)
        self.files[file_id] = obj
        return obj

    async def discard_upload(self, source: str) -> None:
        await anyio.to_thread.run_sync(lambda: Path(source).unlink(missing_ok=True))

    async def delete_file(self, file_id: str) -> None:
        self.files.pop(file_id, None)
        self._scans = {k: v for k, v in self._scans.items() if k[0] != file_id}

        def remove() -> None:
            self._meta_path(file_id).unlink(missing_ok=True)  # first: the file is gone
            self.content_path(file_id).unlink(missing_ok=True)
            journal.fsync_dir(self.root / "files")

        await anyio.to_thread.run_sync(remove)

    async def read_content(self, file_id: str) -> AsyncIterator[bytes]:
        f = await anyio.open_file(self.content_path(file_id), "rb")
        async with f:
            while chunk := await f.read(_WRITE_CHUNK):
                yield chunk

    async def scan(self, file_id: str, endpoint: str | None) -> int:
        """The number of requests of an input file, checked (``journal.scan_input``; a file
        never changes, so each is checked once per endpoint)."""
        key = (file_id, endpoint)
        if key not in self._scans:
            self._scans[key] = await anyio.to_thread.run_sync(
                journal.scan_input, self.content_path(file_id), endpoint)
        return self._scans[key]

    async def read_lines(self, file_id: str, offset: int,
                         count: int) -> tuple[list[InputLine], int]:
        return await anyio.to_thread.run_sync(journal.read_lines, self.content_path(file_id),
                                              offset, count)

    # -- batches ------------------------------------------------------------------------------
    async def save(self, record: BatchRecord) -> None:
        """Write ``record`` as it is when its turn comes (writes of one batch in order)."""
        bid = record.batch.id
        lock = self._locks.setdefault(bid, anyio.Lock())
        async with lock:
            data = _ENCODE.encode(record)
            await anyio.to_thread.run_sync(journal.write_atomic,
                                           self.root / "batches" / f"{bid}.json", data)
        self.batches[bid] = record

    async def remove_journals(self, batch_id: str) -> None:
        def remove() -> None:
            for kind in ("output", "errors"):
                self.journal_path(batch_id, kind).unlink(missing_ok=True)

        await anyio.to_thread.run_sync(remove)

    def in_use(self, file_id: str) -> bool:
        """Whether a batch that has not ended reads ``file_id``."""
        return any(r.batch.input_file_id == file_id and r.batch.status in UNFINISHED
                   for r in self.batches.values())


def _fsync(f: Any) -> None:
    os.fsync(f.fileno())
