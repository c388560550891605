"""Device: where a step's forward pass runs, and how the event loop awaits it.

The loop never blocks on the device. ``launch(fn)`` queues ``fn`` and returns a handle at
once; ``await handle.wait()`` suspends only the step-loop task, so HTTP handlers,
detokenization and grammar work run meanwhile.

On the CPU, one long-lived worker thread runs the queued steps strictly in launch order: it
is the CPU's "stream". (On CUDA, :class:`CUDADevice` enqueues steps on a real stream, mostly
from the loop itself, and awaits events: see its docstring and ``docs/gpu.md``.) In-order
execution is what async scheduling relies on: step N+1 may be launched before step N
finishes, reads step N's sampled ids, and writes KV blocks freed while step N ran only after
step N has ended. When a step ends, the worker wakes the loop with ``call_soon_threadsafe``
(no polling, no thread hop per step beyond that one). Being one thread also keeps one OpenMP
team: a second thread running parallel kernels would start a second team and slow every
kernel on a small CPU.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from asyncengine.executor.runtime.thread_policy import as_compute_thread

T = TypeVar("T")

#: Where eager (not graph-replayed) CUDA steps are enqueued from: loop (default) or thread.
EAGER_LAUNCH_ENV = "ASYNCENGINE_CUDA_EAGER_LAUNCH"


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
        """The step's output: its ``HostResult`` finished (the device has run it)."""
        return _finished(await self._launched())

    async def _launched(self) -> Any:
        """What the launch returned (raising what it raised)."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


def _finished(value: Any) -> Any:
    return value.finish() if isinstance(value, HostResult) else value


class HostResult:
    """A step's result that is complete only once the device has caught up with it (its
    sampled ids still on their way to pinned host memory): ``finish()`` builds the real
    result, on the loop, after the step's event has completed."""

    def finish(self) -> Any:
        raise NotImplementedError


class Device:
    """Runs launched step functions in order on one worker thread.

    What the rest of the engine needs to know of the device is asked here, never by comparing
    ``type``: the traits below, and the start-up hooks that ``executor/build.py`` calls once
    (a subclass overrides them; the defaults are the CPU's)."""

    type: str = "cpu"
    #: The steps compute on the host's cores, beside the event loop: the loop's thread yields
    #: them (``thread_policy.py``), and each verified draft row costs a real part of a step, so
    #: n-gram drafts adapt to their acceptance (``core/spec/ngram.py``).
    computes_on_host: bool = True
    #: The KV cache may be freed and allocated again (sleep level 1, ``engine/sleep.py``):
    #: nothing kept its addresses (CUDA graphs capture them).
    kv_reallocatable: bool = True

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

    def launch_step(self, runner: Any, inputs: Any) -> StepHandle:
        """Queue a prepared step, ``runner.execute(inputs)``, behind the ones launched; its
        handle's ``wait()`` gives the step's output once the worker has run it."""
        return self.launch(partial(runner.execute, inputs))

    def run_at_start_up(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread that ends when it returns (start-up work on the CPU).

        OpenMP gives every thread that runs a parallel region its own team of threads, kept
        until that thread exits. The forward pass runs on the device's worker thread; had the
        loop's thread started a team too, the two teams would overcommit the cores and
        libgomp would put idle team threads to sleep after very short spins: measured on 2
        cores, every parallel kernel then pays a wake-up, and a batch-1 decode step of
        SmolLM2-135M takes ~26 ms instead of ~18 ms. Loading the weights, filling the KV
        cache and compiling are the parallel work done at start-up, so they run here."""
        with ThreadPoolExecutor(1, thread_name_prefix="asyncengine-load") as pool:
            return pool.submit(fn).result()

    def make_staging(self) -> Any:
        """How ``runner.prepare`` turns the step's numpy arrays into tensors."""
        from asyncengine.executor.runtime.staging import DirectStaging

        return DirectStaging()

    # -- start-up (``executor/build.py``; nothing here runs per step) --------------------------
    def memory_at_start(self, config: Any) -> Any:
        """The device's memory before the weights are loaded, where the KV cache is sized by
        a memory profile (``kv/sizing.py``); None where it is not."""
        return None

    def prepare_tensor_parallel(self, config: Any) -> None:
        """Before the tensor-parallel workers start: refuse what this device cannot do."""

    def prepare_model(self, model: Any, attn_backend: Any, config: Any, dtype: Any,
                      max_model_len: int) -> Any:
        """The loaded model and its attention backend made ready for this device (kernels
        compiled now, never at the first step); returns the backend to use."""
        return attn_backend

    def sampling_method(self, vocab_size: int) -> str | None:
        """The sampling kernels this device uses beyond the default (None: torch's)."""
        return None

    def _ensure_worker(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="asyncengine-device",
                                                daemon=True)
                self._thread.start()

    def _work(self) -> None:
        as_compute_thread()
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
    """The CPU: steps run on the worker thread with ``num_threads`` OpenMP threads.

    The number is the worker's own (and its start-up threads'): OpenMP's is a per-thread
    setting, so two engines of one process (a router) each compute with theirs. What stays
    process-wide is torch's default for threads that set none (the last engine built sets
    it) and the cores themselves: two busy engines with a team of every core each share the
    cores, and give ``--threads`` lower than the core count to split them instead."""

    type = "cpu"

    def __init__(self, num_threads: int | None = None) -> None:
        super().__init__()
        self.num_threads = num_threads or os.cpu_count() or 1
        _own_threads(self.num_threads)
        from asyncengine.executor.runtime.cpu_malloc import keep_step_buffers

        keep_step_buffers()  # no page faults per step for the step's large buffers

    def _on_worker_start(self) -> None:
        _own_threads(self.num_threads)

    def run_at_start_up(self, fn: Callable[[], T]) -> T:
        n = self.num_threads
        return super().run_at_start_up(lambda: (_own_threads(n), fn())[1])


def _own_threads(n: int) -> None:
    """This thread's OpenMP team: ``n`` threads. torch sets a thread's count from its global
    default when the thread first asks (``get_num_threads`` does), never again, so asking
    first keeps this thread's count when another engine sets the default later."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(n)
