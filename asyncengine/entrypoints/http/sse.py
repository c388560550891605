"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import msgspec
from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError

encode_json = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"


def event(obj: object) -> bytes:
    return b"data: " + encode_json(obj) + b"\n\n"


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class SSEStream:
    """An open event stream to one client. Writes raise ``ClientGone`` once the client left."""

    def __init__(self, response: web.StreamResponse, done_marker: bool = True) -> None:
        self.response = response
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
        return cls(response, done_marker)

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
