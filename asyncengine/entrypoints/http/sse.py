"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.sender import KEY_SIZE, BatchSender, Connection

encode_json = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"

#: Past this many bytes waiting in a client's socket buffer, outputs are no longer pushed from
#: the loop: the request's handler writes them and waits for the client (steps merge).
PUSH_HIGH_WATER = 1 << 16


def event(obj: object) -> bytes:
    return b"data: " + encode_json(obj) + b"\n\n"


def text_template(make: Callable[[str], object]) -> Callable[[str], bytes]:
    """A renderer for events whose only varying part is one JSON string.

    ``make(text)`` builds the event's object; the bytes before and after the encoded string
    are found once, by rendering a sentinel, so each later event costs one string encoding
    and two concatenations, byte for byte what :func:`event` would have produced."""
    sentinel = "\x00asyncengine:text\x00"
    raw, enc = event(make(sentinel)), encode_json(sentinel)
    head, found, tail = raw.partition(enc)
    if not found or enc in tail:
        raise ValueError("the event template must hold the text exactly once")

    def render(text: str) -> bytes:
        return head + encode_json(text) + tail

    return render


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class SSEStream:
    """An open event stream to one client. Writes raise ``ClientGone`` once the client left."""

    def __init__(self, response: web.StreamResponse, done_marker: bool = True,
                 transport: asyncio.Transport | None = None,
                 sender: BatchSender | None = None) -> None:
        self.response = response
        self.transport = transport
        # aiohttp's payload writer (a private attribute: without it nothing is pushed, and the
        # handler writes everything as for any other response).
        self.writer = getattr(response, "_payload_writer", None)
        # Chat and completions streams end with "data: [DONE]"; the Responses API's do not.
        self.done_marker = done_marker
        # Pushed frames go to the sending thread (see sender.py) when the writer's frames are
        # plain chunks this class can build itself.
        self.sender: BatchSender | None = None
        self.conn: Connection | None = None
        if sender is not None and self._fast_chunks():
            self.conn = sender.connect(transport)
            self.sender = sender if self.conn is not None else None

    @classmethod
    async def open(cls, request: web.Request, done_marker: bool = True,
                   sender: BatchSender | None = None) -> SSEStream:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        })
        await response.prepare(request)
        return cls(response, done_marker, request.transport, sender)

    def _fast_chunks(self) -> bool:
        """Whether the writer's output for a write is one plain chunk (see write_now)."""
        w = self.writer
        return w is not None and w.chunked and getattr(w, "_headers_written", False) and \
            w.length is None and getattr(w, "_compress", 0) is None and \
            getattr(w, "_on_chunk_sent", 0) is None and getattr(w, "on_body_write", 0) is None

    def can_write_now(self) -> bool:
        """Whether :meth:`write_now` may write: the connection is open and the socket's buffer
        is under ``PUSH_HIGH_WATER`` (past it the handler writes and waits for the client).
        With the sending thread: also while frames of this stream are with it."""
        t = self.transport
        if self.writer is None or t is None or t.is_closing():
            return False
        c = self.conn
        if c is not None:
            if c.broken:
                return False
            if c.inflight:
                return True
        return t.get_write_buffer_size() <= PUSH_HIGH_WATER

    def write_now(self, data: bytes, *, checked: bool = False) -> bool:
        """Write without awaiting, from any task on the loop (the engine's emission pushes
        here). False, with nothing written, if :meth:`can_write_now` says no (``checked``:
        the caller has just asked it, with nothing run since)."""
        if not checked and not self.can_write_now():
            return False
        w = self.writer
        c = self.conn
        if c is not None:
            record = b"%s%x\r\n%s\r\n" % (c.key, len(data), data)  # see BatchSender.add
            size = len(record) - KEY_SIZE
            w.buffer_size += size
            w.output_size += size
            if self.sender.can_take(c):
                self.sender.add(c, record)
            else:  # bytes wait in the transport already: after them
                self.transport.write(memoryview(record)[KEY_SIZE:])
            return True
        if self._fast_chunks():
            # What the writer would do for a chunked body, in one transport write.
            frame = b"%x\r\n%s\r\n" % (len(data), data)
            w.buffer_size += len(frame)
            w.output_size += len(frame)
            self.transport.write(frame)
            return True
        step = w.write(data, drain=False)  # completes without suspending
        try:
            step.send(None)
        except StopIteration:
            return True
        step.close()  # unreachable with this writer; never leave a write half done
        raise RuntimeError("the response writer suspended during a synchronous write")

    async def _idle(self) -> None:
        """Let the sending thread finish this stream's frames (the transport writes next)."""
        c = self.conn
        if c is not None:
            if c.inflight:
                await self.sender.idle(c)
            if c.broken:
                raise ClientGone()

    def release(self) -> None:
        """The stream is over (however it ended): give back the sender's hold on it."""
        if self.conn is not None:
            self.sender.release(self.conn)

    async def write(self, data: bytes) -> None:
        """Write one or more already encoded events."""
        await self._idle()
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as e:  # reset, or a transport already closed
            raise ClientGone() from e

    async def send(self, obj: object) -> None:
        await self.write(event(obj))

    async def error(self, error: APIError) -> None:
        """An error in the middle of the stream: an error event, then the stream ends."""
        await self.write(event(error.body()))
        await self.done()

    async def done(self) -> None:
        if self.done_marker:
            await self.write(DONE)
        try:
            await self._idle()
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
