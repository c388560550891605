"""The disk side of batch jobs: blocking functions that the loop runs in worker threads
(``anyio.to_thread.run_sync``), never on itself.

- Metadata is replaced whole: written to a temporary file, fsynced, renamed over the old one
  (and the directory fsynced), so a crash leaves the old version or the new, never a mix.
- A batch's finished lines go to its journals (``.output.jsonl``, ``.errors.jsonl``), each line
  in one ``write`` of the whole line, newline included. A killed process loses nothing
  written (the page cache has it); a crash can leave only the last line torn, which
  ``recover`` cuts off, and the line runs again. Journals are fsynced when closed, not per
  line: after a power loss the lines not yet on disk run again, none twice.
- When the batch ends, ``write_ordered`` copies the journals' lines in the input's order into
  the output and error files (each line once, whatever the journals hold).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import BinaryIO

import msgspec

from asyncengine.entrypoints.batch.protocol import ENDPOINTS, InputLine, LineKey

_LINE = msgspec.json.Decoder(InputLine)
_KEY = msgspec.json.Decoder(LineKey)
_COPY_CHUNK = 1 << 20


class BadInput(Exception):
    """A file that cannot be a batch's input, or an upload refused; ``status`` is the HTTP
    status it answers."""

    def __init__(self, message: str, *, code: str = "invalid_batch_file",
                 param: str | None = None, line: int | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.line = line
        self.status = status


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """A fresh name beside ``path``, which ``remove_leftovers`` recognizes."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def write_atomic(path: Path, data: bytes) -> None:
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_leftovers(directory: Path) -> None:
    """Temporary files of writes a crash interrupted."""
    for p in directory.glob(".*.tmp"):
        p.unlink(missing_ok=True)


def parse_line(raw: bytes, number: int, endpoint: str | None) -> InputLine:
    """One line of an input file; ``endpoint``: the url every line must have (None: any of
    the batch endpoints, as ``run-batch`` takes them)."""
    try:
        line = _LINE.decode(raw)
    except msgspec.ValidationError as e:
        raise BadInput(f"line {number} is not a batch request: {e} (each line is an object "
                       'with "custom_id", "method", "url" and "body")', line=number) from None
    except msgspec.DecodeError:
        raise BadInput(f"line {number} is not JSON: a batch file is JSONL, one JSON object "
                       "a line", code="invalid_jsonl", line=number) from None
    if line.method != "POST":
        raise BadInput(f'line {number}: method must be "POST", got {line.method!r}',
                       line=number)
    if line.url not in ENDPOINTS or (endpoint is not None and line.url != endpoint):
        allowed = endpoint or ", ".join(ENDPOINTS)
        raise BadInput(f"line {number}: url {line.url!r} is not allowed (this batch runs "
                       f"{allowed})", code="invalid_url", line=number)
    if not bytes(line.body).lstrip().startswith(b"{"):
        raise BadInput(f"line {number}: body must be a JSON object", line=number)
    return line


def scan_input(path: Path, endpoint: str | None) -> int:
    """Check every line of an input file; the number of requests. ``BadInput`` names the
    first bad line: not JSON, not a request, a url not allowed, a ``custom_id`` seen before."""
    seen: set[str] = set()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = parse_line(raw, number, endpoint)
            if line.custom_id in seen:
                raise BadInput(f"line {number}: duplicate custom_id {line.custom_id!r} (each "
                               "line needs its own)", code="duplicate_custom_id", line=number)
            seen.add(line.custom_id)
    if not seen:
        raise BadInput("the file holds no requests")
    return len(seen)


def read_lines(path: Path, offset: int, count: int) -> tuple[list[InputLine], int]:
    """Up to ``count`` requests of a checked input file from byte ``offset``; the offset
    after them."""
    lines: list[InputLine] = []
    with open(path, "rb") as f:
        f.seek(offset)
        while len(lines) < count:
            raw = f.readline()
            if not raw:
                break
            if raw.strip():
                lines.append(_LINE.decode(raw))
        return lines, f.tell()


class Journal:
    """A file of finished lines, appended to one whole line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


def recover(path: Path) -> list[str]:
    """The ``custom_id`` of every whole line of a journal, in order; a torn last line (a
    crash in its write) is cut off the file, so that the next append starts a line."""
    if not path.exists():
        return []
    ids: list[str] = []
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                ids.append(_KEY.decode(raw).custom_id)
            except msgspec.DecodeError:
                pass
            offset += len(raw)
    if offset != path.stat().st_size:
        os.truncate(path, offset)
    return ids


def write_ordered(input_path: Path, journals: list[Path], out: BinaryIO) -> int:
    """Copy the journals' lines to ``out`` in the order of the input file's requests, each
    ``custom_id`` once; the bytes written."""
    index: dict[str, tuple[int, int, int]] = {}  # custom_id -> (journal, offset, length)
    for j, path in enumerate(journals):
        if not path.exists():
            continue
        with open(path, "rb") as f:
            offset = 0
            for raw in f:
                if raw.endswith(b"\n"):
                    try:
                        index.setdefault(_KEY.decode(raw).custom_id, (j, offset, len(raw)))
                    except msgspec.DecodeError:
                        pass
                offset += len(raw)
    sources = [open(p, "rb") if p.exists() else None for p in journals]  # noqa: SIM115
    written = 0
    try:
        with open(input_path, "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                hit = index.pop(_KEY.decode(raw).custom_id, None)
                if hit is None:
                    continue
                source = sources[hit[0]]
                assert source is not None
                source.seek(hit[1])
                out.write(source.read(hit[2]))
                written += hit[2]
    finally:
        for s in sources:
            if s is not None:
                s.close()
    return written


def write_ordered_file(input_path: Path, journals: list[Path], dest: Path) -> int:
    """``write_ordered`` into ``dest``, atomically."""
    tmp = temp_path(dest)
    try:
        with open(tmp, "wb") as out:
            size = write_ordered(input_path, journals, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)
    return size


def copy_out(source: Path, out: BinaryIO) -> None:
    with open(source, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            out.write(chunk)
    out.flush()
