"""A simulated CUDA stream and its events, for the CUDA device on a machine without a GPU.

``CUDADevice`` makes its few CUDA calls through an object (``TorchCUDA`` on a GPU);
:class:`SimulatedCUDA` stands in for it, so that the engine runs its real CUDA step path —
steps enqueued from the loop, pending host results, events awaited by the waiter thread or by
polling — on the CPU. Tests use it to check that path, and ``asyncengine bench host`` to
measure what the host does per step while a GPU would be busy.

The stream runs its work in order, as a CUDA stream does: work of ``seconds`` enqueued at time
``t`` starts at ``max(t, end of the work before it)`` and ends ``seconds`` later; an event
recorded on the stream completes when the work enqueued before it has ended. What enqueues
work is the caller's choice: the simulated model (``simulated_gpu.py``) enqueues each
forward pass's GPU time, :class:`SimulatedCUDA`'s ``delay`` a fixed time per event. The
stream keeps one record per piece of work, from which the GPU's idle time (the gaps) is read.

Times are ``time.perf_counter()`` seconds. An event's ``synchronize`` sleeps until it is due
(releasing the GIL, as CUDA's driver call does); it wakes up to ~0.1 ms late, where CUDA's
waiter spins, which delays the host's processing of a step but not the stream.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

#: ``StepRecord.tokens`` of work that is not a forward pass (an event's ``delay``).
NO_TOKENS = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One piece of work on the stream: when it was enqueued, ran and ended, and its size."""

    launched: float
    start: float
    end: float
    tokens: int


class SimulatedEvent:
    """An event that completes ``delay`` seconds after it is made (``at``: at that
    ``perf_counter`` time), or, with ``delay=None``, when :meth:`release` is called. Once
    complete, ``query`` and ``synchronize`` raise ``error`` if one is given (a CUDA error).
    ``queries`` counts ``query`` calls, ``sync_threads`` the threads that synchronized."""

    def __init__(self, delay: float | None = 0.0, error: BaseException | None = None, *,
                 at: float | None = None) -> None:
        self.done_at = at if at is not None else (
            None if delay is None else time.perf_counter() + delay)
        self._released = threading.Event() if self.done_at is None else None
        self.error = error
        self.queries = 0
        self.sync_threads: list[int] = []

    def release(self) -> None:
        self.done_at = time.perf_counter()
        if self._released is not None:
            self._released.set()

    def query(self) -> bool:
        self.queries += 1
        done = self.done_at is not None and time.perf_counter() >= self.done_at
        if done and self.error is not None:
            raise self.error
        return done

    def synchronize(self) -> None:
        self.sync_threads.append(threading.get_ident())
        if self._released is not None:
            self._released.wait()
        else:
            remaining = self.done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        if self.error is not None:
            raise self.error


class SimulatedStream:
    """A stream that runs enqueued work in order (see the module's docstring)."""

    def __init__(self) -> None:
        self.tail = 0.0  # when the work enqueued so far ends
        self.records: list[StepRecord] = []

    def enqueue(self, seconds: float, tokens: int = NO_TOKENS) -> None:
        now = time.perf_counter()
        start = max(now, self.tail)
        self.tail = start + seconds
        self.records.append(StepRecord(now, start, self.tail, tokens))


class SimulatedCUDA:
    """``CUDADevice``'s CUDA calls (``TorchCUDA``), simulated. Each recorded event first
    enqueues ``delay`` seconds of work (0: the event only waits for the work before it);
    ``enqueued_on`` lists the thread that entered the stream for each enqueue."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.enqueued_on: list[str] = []

    def new_stream(self) -> SimulatedStream:
        return SimulatedStream()

    def on_stream(self, stream: SimulatedStream) -> contextlib.AbstractContextManager[None]:
        self.enqueued_on.append(threading.current_thread().name)
        return contextlib.nullcontext()

    def set_stream(self, stream: SimulatedStream) -> None:
        pass

    def record_event(self, stream: SimulatedStream) -> SimulatedEvent:
        if self.delay:
            stream.enqueue(self.delay)
        return SimulatedEvent(at=stream.tail)


def on_simulated_cuda(engine: Any, awaiter: str | None = "thread",
                      cuda: SimulatedCUDA | None = None) -> Any:
    """Put ``engine`` (an ``AsyncEngine`` built on the CPU) on the CUDA step path: a
    ``CUDADevice`` over ``cuda`` (a :class:`SimulatedCUDA` by default) and the pinned
    staging's packing into one upload (unpinned, on the CPU). Returns the device."""
    from asyncengine.executor.runtime.cuda_device import CUDADevice
    from asyncengine.executor.runtime.staging import PinnedStaging

    device = CUDADevice(awaiter=awaiter, cuda=cuda or SimulatedCUDA(delay=0.001))
    engine.device = engine.parts.device = engine.loop.device = device
    engine.runner.staging = PinnedStaging("cpu", pin=False)
    return device


@dataclass(frozen=True)
class GPUIdle:
    """The stream's idle time over a run of steps, as ``benchmarks/gpu.py`` measures it on a
    GPU: the gaps between one step's end and the next one's start."""

    steps: int
    busy_s: float
    idle_s: float
    median_period_s: float  # start to start

    @property
    def idle_percent(self) -> float:
        total = self.busy_s + self.idle_s
        return 100 * self.idle_s / total if total > 0 else 0.0


def gpu_idle(records: list[StepRecord], tokens: int | None = None) -> GPUIdle:
    """The idle time between consecutive ``records`` (forward passes only); with
    ``tokens``, only between consecutive steps of that many tokens (a full batch's
    steady state, as on the GPU)."""
    steps = [r for r in records if r.tokens != NO_TOKENS]
    pairs = [(a, b) for a, b in zip(steps, steps[1:], strict=False)
             if tokens is None or a.tokens == b.tokens == tokens]
    if not pairs:
        return GPUIdle(0, 0.0, 0.0, 0.0)
    periods = sorted(b.start - a.start for a, b in pairs)
    return GPUIdle(len(pairs), sum(a.end - a.start for a, _ in pairs),
                   sum(b.start - a.end for a, b in pairs), periods[len(periods) // 2])
