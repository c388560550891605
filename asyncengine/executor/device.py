"""Device: where a step's forward pass runs, and how the event loop awaits it.

The loop never blocks on the device. ``launch(fn)`` starts ``fn`` and returns a handle at once;
``await handle.wait()`` suspends only the step-loop task, so HTTP handlers, detokenization and
grammar work run meanwhile.

* CPU: the worker thread is the CPU's "stream". ``fn`` runs there (torch releases the GIL in its
  kernels); nothing else of the engine runs off the loop.
* CUDA: the same worker thread enqueues the kernels and waits for the sampled ids.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread


class StepHandle:
    """The result of a launched step, awaited by the step loop."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Device:
    """Launches step functions; subclasses decide where they run."""

    type: str = "cpu"

    def __init__(self) -> None:
        # One step in flight at a time: the worker is a single thread.
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device(self.type)

    async def launch(self, tg: anyio.abc.TaskGroup, fn: Callable[[], Any]) -> StepHandle:
        """Start ``fn`` on the device; return once it is running (not finished)."""
        handle = StepHandle()
        tg.start_soon(self._run, handle, fn)
        # Let the task start the worker before the caller does its overlapped work.
        await anyio.lowlevel.checkpoint()
        return handle

    async def _run(self, handle: StepHandle, fn: Callable[[], Any]) -> None:
        try:
            result = await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        except BaseException as e:  # delivered to the awaiting step loop
            handle._finish(error=e)
            if not isinstance(e, Exception):
                raise
        else:
            handle._finish(result)

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
    sampled ids, so the loop never blocks on the GPU. (Stage two: launch from the loop and await
    a CUDA event, keeping sampled ids on the device for the next step.)"""

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
