"""Pushed SSE writes off the event loop's thread: one native thread sends a step's frames.

A step's emission pushes one SSE frame per stream (``RequestStream.set_push``). Written from
the loop, each is a ``send(2)``: 7-9 us of CPU for 150 bytes on loopback, which is most of
what a stream costs the loop per step (the kernel's TCP path runs in the caller). Here the
loop only queues the frames (``add``); after the step's emission, ``flush`` copies them in
one call to a native thread (``batch_send.cpp``) that sends them without the GIL while the
loop goes on with the next step. It reports through an eventfd the loop watches.

Order per connection is the invariant, and these rules keep it:

* A frame goes to the thread only while the connection's transport holds nothing unsent, or
  while earlier frames of the connection are with the thread (``inflight``): then the thread
  sends it, or diverts it (below), after them.
* The thread sends without blocking. A frame it cannot send whole diverts its connection:
  that frame's rest and the connection's later frames come back unsent, and the loop writes
  them through the transport in the order submitted (batches complete in order). The
  connection goes back to the thread once none of its frames is in flight.
* The request's handler writes through the transport as before (its first and last events,
  a stream that fell behind), but first waits until no frame of its connection is in flight
  (``idle``).

The thread writes to a duplicate of the socket's descriptor, closed once the stream has
ended and its last frame is sent, so a descriptor number reused by a new connection is never
written to. TLS connections, a machine where the native half cannot be built (no compiler,
not Linux) and ``ASYNCENGINE_BATCH_SEND=0`` keep every write on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections import deque
from collections.abc import Callable

import torch

from asyncengine.config import environment

logger = logging.getLogger("asyncengine.entrypoints.http")

_OPEN, _SUBMIT, _POLL, _RESUME, _CLOSE = range(5)
_ARGS = ("int64_t", "int64_t", "const int64_t*", "const uint8_t*", "int64_t", "int64_t",
         "int64_t*")
_NO_INTS = torch.zeros(1, dtype=torch.int64)
_NO_BYTES = torch.zeros(1, dtype=torch.uint8)
#: A record's connection key: its id and descriptor, two native int64.
KEY_SIZE = 16


def enabled() -> bool:
    return environment.on("ASYNCENGINE_BATCH_SEND")


def _native() -> Callable[..., None] | None:
    from asyncengine.executor.kernels.build import load

    return load("batch_send", _ARGS)


class Connection:
    """One stream's connection, as the sender sees it (loop-side state)."""

    __slots__ = ("id", "fd", "key", "transport", "inflight", "diverted", "broken", "released",
                 "waiter")

    def __init__(self, id_: int, fd: int, transport: asyncio.Transport) -> None:
        self.id = id_
        self.fd = fd  # a duplicate, this object's own
        self.key = struct.pack("=qq", id_, fd)  # what a record for it begins with
        self.transport = transport
        self.inflight = 0  # frames with the thread
        self.diverted = False  # the thread returns this connection's frames unsent
        self.broken = False  # a send failed: the client is gone
        self.released = False  # the stream ended: close the descriptor once idle
        self.waiter: asyncio.Future[None] | None = None


class BatchSender:
    """The loop's side of the sending thread. Everything here runs on the loop."""

    def __init__(self, fn: Callable[..., None], loop: asyncio.AbstractEventLoop) -> None:
        self._fn = fn
        self._loop = loop
        out = torch.zeros(2, dtype=torch.int64)
        fn(_OPEN, 0, _NO_INTS, _NO_BYTES, 0, 0, out)
        handle, efd = out.tolist()
        if handle <= 0:
            raise OSError(-handle, "the batch sender could not start")
        self._handle, self._efd = handle, efd
        self._results = torch.zeros(1 + 1024, dtype=torch.int64)
        self._pending: list[tuple[Connection, bytes]] = []
        self._submitted: deque[list[tuple[Connection, bytes]]] = deque()
        self._flush_scheduled = False
        self._next_id = 1
        self._closed = False
        self.num_sent = 0  # frames the thread sent whole
        self.num_diverted = 0  # frames (or their rest) the loop wrote after a divert
        loop.add_reader(efd, self._on_done)

    @classmethod
    def start(cls, loop: asyncio.AbstractEventLoop | None = None) -> BatchSender | None:
        """A sender for the running loop, or None where it cannot run (see the module)."""
        if not enabled():
            return None
        fn = _native()
        if fn is None:
            return None
        try:
            return cls(fn, loop or asyncio.get_running_loop())
        except (OSError, RuntimeError) as e:
            logger.warning("pushed SSE writes stay on the event loop: %s", e)
            return None

    def connect(self, transport: asyncio.Transport | None) -> Connection | None:
        """The sender's state for a plain TCP connection (None: TLS, not a socket)."""
        if self._closed or transport is None or transport.get_extra_info("sslcontext"):
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        try:
            fd = os.dup(sock.fileno())
        except OSError:
            return None
        conn = Connection(self._next_id, fd, transport)
        self._next_id += 1
        return conn

    def can_take(self, conn: Connection) -> bool:
        """Whether a frame of ``conn`` may be queued now without reordering its bytes."""
        return not conn.broken and not self._closed and (
            conn.inflight > 0 or not conn.transport.get_write_buffer_size())

    def add(self, conn: Connection, record: bytes) -> None:
        """Queue a record for ``conn`` (``can_take`` said yes): ``conn.key`` followed by one
        HTTP/1.1 chunk, ``b"%x\\r\\n%s\\r\\n" % (len(data), data)``, the frame sent, in one
        bytes object (one formatting per frame). Sent after ``flush``."""
        conn.inflight += 1
        self._pending.append((conn, record))
        if not self._flush_scheduled:  # the engine flushes after emission; this is the net
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand the frames queued so far to the thread, in one call."""
        self._flush_scheduled = False
        pending = self._pending
        if not pending or self._closed:
            return
        self._pending = []
        data = bytearray().join([record for _, record in pending])
        if len(pending) + 1 > self._results.numel():
            self._results = torch.zeros(2 * len(pending) + 1, dtype=torch.int64)
        self._submitted.append(pending)
        self._fn(_SUBMIT, self._handle, _NO_INTS, torch.frombuffer(data, dtype=torch.uint8),
                 len(pending), len(data), _NO_INTS)

    def _on_done(self) -> None:
        """The thread finished batches: settle their frames, write what it diverted."""
        out = self._results
        self._fn(_POLL, self._handle, _NO_INTS, _NO_BYTES, out.numel() - 1, 0, out)
        batches = int(out[0])
        if not batches:
            return
        entries = [e for _ in range(batches) for e in self._submitted.popleft()]
        sent = out[1:1 + len(entries)].tolist()
        whole = len(entries)
        for (conn, record), n in zip(entries, sent, strict=True):
            conn.inflight -= 1
            if n != len(record) - KEY_SIZE:
                whole -= 1
                conn.diverted = True
                if n < 0:
                    conn.broken = True
                elif not conn.broken and not conn.transport.is_closing():
                    conn.transport.write(memoryview(record)[KEY_SIZE + n:])
                    self.num_diverted += 1
            if not conn.inflight:
                self._settle(conn)
        self.num_sent += whole

    def _settle(self, conn: Connection) -> None:
        """``conn`` has no frame in flight any more."""
        if conn.diverted:
            conn.diverted = False
            if not self._closed:
                self._fn(_RESUME, self._handle, torch.tensor([conn.id]), _NO_BYTES, 0, 0,
                         _NO_INTS)
        if conn.released and conn.fd >= 0:
            os.close(conn.fd)
            conn.fd = -1
        waiter, conn.waiter = conn.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def idle(self, conn: Connection) -> None:
        """Return once no frame of ``conn`` is in flight (the transport may write next)."""
        while conn.inflight:
            if conn.waiter is None or conn.waiter.done():
                conn.waiter = self._loop.create_future()
            await asyncio.shield(conn.waiter)

    def release(self, conn: Connection) -> None:
        """The stream ended: its descriptor closes once its last frame is sent."""
        conn.released = True
        if not conn.inflight and conn.fd >= 0:
            os.close(conn.fd)
            conn.fd = -1

    def close(self) -> None:
        """Stop the thread (what it holds is sent first) and settle every frame."""
        if self._closed:
            return
        self.flush()
        self._loop.remove_reader(self._efd)
        self._closed = True
        self._fn(_CLOSE, self._handle, _NO_INTS, _NO_BYTES, 0, 0, _NO_INTS)
        for batch in self._submitted:  # sent or not, nothing will report them now
            for conn, _ in batch:
                conn.inflight -= 1
                if not conn.inflight:
                    self._settle(conn)
        self._submitted.clear()
