"""Awaiting a CUDA event from the event loop without blocking it: two mechanisms, one interface.

The CUDA device records an event after a step's kernels (and the copy of its sampled ids into
pinned host memory); the step loop awaits it. The loop's thread must never block in the CUDA
driver, so the wait is done one of two ways:

* ``thread`` (the default): one long-lived waiter thread calls ``event.synchronize()`` (the
  driver call releases the GIL) for each awaited event in turn, and wakes the loop with
  ``loop.call_soon_threadsafe``. Latency: one thread wake-up (a few µs to tens of µs). Cost:
  the waiter spins in the driver while it waits (CUDA's default event flags), so one core is
  busy while the GPU is. An event that has already completed is returned at once, with no hop.
* ``poll``: the loop itself asks ``event.query()``, sleeping between questions with an
  exponential backoff (20 µs doubling up to 1 ms). No thread, no core spent waiting; but
  asyncio's epoll selector rounds every timeout up to a whole millisecond, so when nothing
  else wakes the loop a sleep under 1 ms lasts about 1 ms: the result of a step may be seen
  up to ~1 ms late. With step N+1 already queued behind N, that delays the host's work on N,
  not the GPU, as long as the host's work per step stays shorter than a step.

Choose with ``ASYNCENGINE_CUDA_AWAIT=thread|poll``. Which is cheaper is to be measured on a
GPU (``benchmarks/gpu.py`` reports GPU idle time per step under either); neither has run on
a GPU yet.

Events are duck-typed: anything with ``query() -> bool`` and ``synchronize()`` works (the
tests drive both mechanisms with fake events on the CPU). Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Protocol

import anyio

from asyncengine.config import environment

ENV = "ASYNCENGINE_CUDA_AWAIT"
MECHANISMS = ("thread", "poll")


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class EventAwaiter(Protocol):
    """Suspends the awaiting task until ``event`` has completed; the loop runs other tasks
    meanwhile. An error raised by the event's ``query``/``synchronize`` (a CUDA error) is
    raised to the awaiting task. Cancelling the awaiting task never hangs."""

    name: str

    async def wait(self, event: Event) -> None: ...

    def close(self) -> None: ...


class ThreadEventAwaiter:
    """A waiter thread synchronizes the events in the order they are awaited."""

    name = "thread"

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Event, asyncio.AbstractEventLoop,
                                             asyncio.Future[None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def wait(self, event: Event) -> None:
        if event.query():  # already done: no thread hop
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._ensure_thread()
        self._queue.put((event, loop, future))
        # Cancellation cancels the future; the waiter thread then finds it done and drops it.
        await future

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="asyncengine-cuda-waiter")
                self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, loop, future = item
            error: BaseException | None = None
            if not future.done():  # not cancelled meanwhile
                try:
                    event.synchronize()
                except BaseException as e:  # delivered to the awaiting task
                    error = e
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


class PollEventAwaiter:
    """The loop polls ``event.query()``, sleeping ``first_s``, then twice as long each time,
    up to ``max_s``, between polls."""

    name = "poll"

    def __init__(self, first_s: float = 20e-6, max_s: float = 1e-3) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"poll backoff: need 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s

    async def wait(self, event: Event) -> None:
        delay = self.first_s
        while not event.query():
            await anyio.sleep(delay)
            delay = min(2 * delay, self.max_s)

    def close(self) -> None:
        pass


def make_event_awaiter(name: str | None = None) -> EventAwaiter:
    """The mechanism named by ``name``, else by ``$ASYNCENGINE_CUDA_AWAIT``, else ``thread``."""
    chosen = name or environment.get(ENV)
    if chosen == "thread":
        return ThreadEventAwaiter()
    if chosen == "poll":
        return PollEventAwaiter()
    raise ValueError(f"{ENV}={chosen!r}: unknown CUDA await mechanism (allowed: "
                     f"{', '.join(MECHANISMS)})")
