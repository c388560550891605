"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError

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
                 transport: asyncio.Transport | None = None) -> None:
        self.response = response
        self.transport = transport
        # aiohttp's payload writer (a private attribute: without it nothing is pushed, and the
        # handler writes everything as for any other response).
        self._writer = getattr(response, "_payload_writer", None)
        # Chat and completions streams end with "data: [DONE]"; the Responses API's do not.
        self.done_marker = done_marker

    @classmethod
    async def open(cls, request: web.Request, done_marker: bool = True) -> SSEStream:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        })
        await response.prepare(request)
        return cls(response, done_marker, request.transport)

    def can_write_now(self) -> bool:
        """Whether :meth:`write_now` may write: the connection is open and the socket's buffer
        is under ``PUSH_HIGH_WATER`` (past it the handler writes and waits for the client)."""
        t = self.transport
        return self._writer is not None and t is not None and not t.is_closing() and \
            t.get_write_buffer_size() <= PUSH_HIGH_WATER

    def write_now(self, data: bytes, *, checked: bool = False) -> bool:
        """Write without awaiting, from any task on the loop (the engine's emission pushes
        here). False, with nothing written, if :meth:`can_write_now` says no (``checked``:
        the caller has just asked it, with nothing run since)."""
        if not checked and not self.can_write_now():
            return False
        w = self._writer
        if w.chunked and getattr(w, "_headers_written", False) and w.length is None and \
                getattr(w, "_compress", 0) is None and getattr(w, "_on_chunk_sent", 0) is None \
                and getattr(w, "on_body_write", 0) is None:
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

    async def write(self, data: bytes) -> None:
        """Write one or more already encoded events."""
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
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
