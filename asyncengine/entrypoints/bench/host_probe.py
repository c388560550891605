"""What ``asyncengine bench host`` reads off a running engine: the loop thread's CPU, split
by where it went, and the simulated GPU's timeline.

* The step loop's phases: ``StepLoop.phase_cpu_s`` (``time.thread_time`` marks in the loop).
* Reading a step's ids back (``PendingOutput.finish``, inside the awaited step handle, so
  outside the loop's marks): timed here around each step's pending output; reported with
  ``update``.
* Consumers: the loop thread's CPU in the steps of every task but the step loop's (each
  stream's ``generate()`` consumer, the HTTP handlers, the engine's abort reaper), timed by a
  task factory that wraps each new task's coroutine. Timing a task step costs ~1 µs of CPU
  in a VM (two ``thread_time`` system calls and the wrapper), about half of it inside the
  interval it measures: both are measured at start-up (:func:`clock_costs`) and taken out,
  the first from the consumers' figure, the whole from the loop's total.
* The rest: the loop thread's CPU outside both (the event loop itself, callbacks such as
  the sockets' reads and the waiter thread's wake-ups, the step loop's awaits).

A snapshot is taken on the loop's thread (``thread_time`` is per thread); the figures of a
run are the difference of two.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import threading
import time
import types
from collections.abc import Coroutine
from typing import Any

from asyncengine.engine.step_loop import PHASES, STEP_LOOP_TASK


@functools.cache
def clock_costs(n: int = 5000) -> tuple[float, float]:
    """(seconds a timed task step's interval adds to what it measures, seconds timing it
    adds to the thread's CPU), the medians of 5 runs of ``n`` steps of an empty task."""

    @types.coroutine
    def forever() -> Any:
        while True:
            yield

    async def idle() -> None:
        await forever()

    inside, added = [], []
    for _ in range(5):
        direct = idle()
        direct.send(None)
        start = time.thread_time()
        for _ in range(n):
            direct.send(None)
        base = time.thread_time() - start
        times = TaskTimes(calibrated=False)
        timed = _Timed(idle(), times)
        timed.send(None)
        times.cpu_s = 0.0
        start = time.thread_time()
        for _ in range(n):
            timed.send(None)
        inside.append(times.cpu_s / n)
        added.append((time.thread_time() - start - base) / n)
        direct.close()
        timed.close()
    return statistics.median(inside), statistics.median(added)


@functools.cache
def bare_wakeup_s(tasks: int = 256, rounds: int = 200) -> float:
    """The loop thread's CPU for one bare asyncio wake-up: an ``asyncio.Event`` set, and its
    waiting task's step back to its next wait (the median of 5 runs of ``tasks`` tasks woken
    ``rounds`` times each, in an event loop of its own). The unit the issue counts a
    stream's cost per step in."""

    async def run() -> float:
        events = [asyncio.Event() for _ in range(tasks)]
        woken = 0

        async def waiter(ev: asyncio.Event) -> None:
            nonlocal woken
            while True:
                await ev.wait()
                ev.clear()
                woken += 1

        workers = [asyncio.ensure_future(waiter(ev)) for ev in events]
        await asyncio.sleep(0)
        start = time.thread_time()
        for _ in range(rounds):
            for ev in events:
                ev.set()
            await asyncio.sleep(0)  # every woken task runs once before this returns
            await asyncio.sleep(0)
        spent = time.thread_time() - start
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        return spent / max(woken, 1)

    return statistics.median(asyncio.run(run()) for _ in range(5))


class TaskTimes:
    """The loop thread's CPU in the steps of every task created after :meth:`install` on
    that loop, but the step loop's; ``steps``: how many steps were timed."""

    def __init__(self, calibrated: bool = True) -> None:
        self.cpu_s = 0.0
        self.steps = 0
        self.inside_s, self.added_s = clock_costs() if calibrated else (0.0, 0.0)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
            timed = _Timed(coro, self)
            task = asyncio.Task(timed, loop=loop, **kwargs)
            timed.task = task
            return task

        loop.set_task_factory(factory)


class _Timed(Coroutine):
    """A task's coroutine whose every step (``send``/``throw``) is timed on the thread."""

    __slots__ = ("_coro", "_times", "task")

    def __init__(self, coro: Any, times: TaskTimes) -> None:
        self._coro = coro
        self._times: TaskTimes | None = times
        self.task: asyncio.Task | None = None

    def _check(self) -> None:
        # The task's name is set after the factory returns, before its first step.
        if self.task.get_name() == STEP_LOOP_TASK:
            self._times = None
        self.task = None

    def send(self, value: Any) -> Any:
        if self.task is not None:
            self._check()
        times = self._times
        if times is None:
            return self._coro.send(value)
        start = time.thread_time()
        try:
            return self._coro.send(value)
        finally:
            times.cpu_s += time.thread_time() - start
            times.steps += 1

    def throw(self, *args: Any) -> Any:
        if self.task is not None:
            self._check()
        times = self._times
        if times is None:
            return self._coro.throw(*args)
        start = time.thread_time()
        try:
            return self._coro.throw(*args)
        finally:
            times.cpu_s += time.thread_time() - start
            times.steps += 1

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self._coro.__await__()

    def __getattr__(self, name: str) -> Any:  # cr_frame, cr_running, ... (anyio reads them)
        return getattr(self._coro, name)


class Probe:
    """Counters of one engine on the simulated GPU (``stream``), read by :meth:`snapshot`."""

    def __init__(self, engine: Any, stream: Any) -> None:
        self.engine = engine
        self.stream = stream
        self.tasks = TaskTimes()
        self.readback_s = 0.0
        self.gc_s = 0.0  # the loop thread's CPU in the garbage collector (in the figures above)
        self._gc_start: float | None = None
        self._thread = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        runner = engine.runner
        execute = runner.execute

        def timed_execute(inputs: Any) -> Any:
            out = execute(inputs)
            finish = out.finish

            def timed_finish() -> Any:
                start = time.thread_time()
                try:
                    return finish()
                finally:
                    self.readback_s += time.thread_time() - start

            out.finish = timed_finish
            return out

        runner.execute = timed_execute

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_start = time.thread_time()
        elif self._gc_start is not None:
            self.gc_s += time.thread_time() - self._gc_start
            self._gc_start = None

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def install(self) -> None:
        """Time the tasks made from now on (call on the loop, before the consumers start)."""
        self.tasks.install(asyncio.get_running_loop())

    def snapshot(self) -> dict[str, Any]:
        """The counters now; call on the loop's thread."""
        loop = self.engine.loop
        return {"wall_s": time.perf_counter(), "loop_cpu_s": time.thread_time(),
                "process_cpu_s": time.process_time(), "phases": dict(loop.phase_cpu_s),
                "readback_s": self.readback_s, "consumers_s": self.tasks.cpu_s,
                "timed_task_steps": self.tasks.steps, "gc_s": self.gc_s,
                "steps": loop.num_steps, "stream_steps": loop.num_stream_steps,
                "records": len(self.stream.records)}


def split(before: dict[str, Any], after: dict[str, Any],
          costs: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """The loop thread's CPU seconds between two snapshots, by where it went: the phases
    (``update`` with the read-back), ``consumers``, ``rest``, and ``total``; the cost of
    timing the consumers (``costs``: :func:`clock_costs`) taken out, and given as
    ``timing``."""
    phases = {p: after["phases"][p] - before["phases"][p] for p in PHASES}
    phases["update"] += after["readback_s"] - before["readback_s"]
    timed = after["timed_task_steps"] - before["timed_task_steps"]
    inside, added = costs
    total = after["loop_cpu_s"] - before["loop_cpu_s"] - timed * added
    consumers = max(0.0, after["consumers_s"] - before["consumers_s"] - timed * inside)
    return {**phases, "consumers": consumers,
            "rest": total - sum(phases.values()) - consumers, "total": total,
            "timing": timed * added}
