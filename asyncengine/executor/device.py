"""Device: where a step's forward pass runs, and how the event loop awaits it.

The loop never blocks on the device. ``launch(fn)`` queues ``fn`` and returns a handle at
once; ``await handle.wait()`` suspends only the step-loop task, so HTTP handlers,
detokenization and grammar work run meanwhile.

One long-lived worker thread runs the queued steps strictly in launch order: it is the CPU's
"stream" (on CUDA it enqueues the kernels on the device's stream). In-order execution is what
async scheduling relies on: step N+1 may be launched before step N finishes, reads step N's
sampled ids, and writes KV blocks freed while step N ran only after step N has ended. When a
step ends, the worker wakes the loop with ``call_soon_threadsafe`` (no polling, no thread
hop per step beyond that one). Being one thread also keeps one OpenMP team: a second thread
running parallel kernels would start a second team and slow every kernel on a small CPU.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread


class StepHandle:
    """The result of a launched step, awaited by the step loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._done = anyio.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Device:
    """Runs launched step functions in order on one worker thread."""

    type: str = "cpu"

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], StepHandle] | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Seconds the worker spent running steps (for the overhead benchmark: the rest of the
        # wall time, with requests running, the device waited for the host).
        self.busy_s = 0.0

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device(self.type)

    def launch(self, fn: Callable[[], Any]) -> StepHandle:
        """Queue ``fn`` behind the steps already launched; return at once. Call on the loop."""
        handle = StepHandle(asyncio.get_running_loop())
        self._ensure_worker()
        self._queue.put((fn, handle))
        return handle

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="asyncengine-device",
                                                daemon=True)
                self._thread.start()

    def _work(self) -> None:
        self._on_worker_start()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, handle = item
            start = time.perf_counter()
            try:
                result, error = fn(), None
            except BaseException as e:  # delivered to the awaiting step loop
                result, error = None, e
            self.busy_s += time.perf_counter() - start
            try:
                handle._loop.call_soon_threadsafe(handle._finish, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _on_worker_start(self) -> None:
        pass

    def close(self) -> threading.Thread | None:
        """Stop the worker once the steps already queued have run; returns the thread to
        join (a later ``launch`` starts a new worker, which must not overlap the old one)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        return thread

    async def aclose(self) -> None:
        """:meth:`close`, then wait (off the loop) until the worker has finished."""
        thread = self.close()
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)

    def synchronize(self) -> None:
        pass


class CPUDevice(Device):
    type = "cpu"

    def __init__(self, num_threads: int | None = None) -> None:
        super().__init__()
        import torch

        torch.set_num_threads(num_threads or os.cpu_count() or 1)


class CUDADevice(Device):
    """CUDA: the worker thread enqueues the step's kernels and waits for the host copy of the
    sampled ids, so the loop never blocks on the GPU."""

    type = "cuda"

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


def make_device(device: str, num_threads: int | None = None) -> Device:
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
        return CUDADevice()
    return CPUDevice(num_threads)
