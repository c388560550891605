"""The CUDA device: steps enqueued on one stream, awaited through events (``device.py`` has
the interface and the CPU's device)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from asyncengine.config import environment
from asyncengine.executor.runtime.cuda_await import EventAwaiter, make_event_awaiter
from asyncengine.executor.runtime.device import (
    EAGER_LAUNCH_ENV,
    Device,
    StepHandle,
    _finished,
)

T = TypeVar("T")

logger = logging.getLogger("asyncengine.executor.build")


class CUDAStepHandle(StepHandle):
    """A step enqueued on the CUDA stream: awaiting it awaits, in turn, its launch (when the
    launcher thread enqueues it) and the event recorded after its kernels."""

    def __init__(self, loop: asyncio.AbstractEventLoop, awaiter: EventAwaiter,
                 on_launched: Callable[[], None] | None = None,
                 release: Callable[[Any], None] | None = None) -> None:
        super().__init__(loop)
        self._awaiter = awaiter
        self._on_launched = on_launched
        self._release = release  # gives the event back once awaited (TorchCUDA's pool)
        self._event: Any = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        # Called on the loop once the step is enqueued: result is (value, event).
        if self._on_launched is not None:
            self._on_launched()
            self._on_launched = None
        if error is None:
            result, self._event = result
        super()._finish(result, error)

    async def wait(self) -> Any:
        value = await self._launched()  # enqueued (an error while enqueueing is raised here)
        event = self._event
        if event is not None:  # the step's copies to pinned memory are done after it
            await self._awaiter.wait(event)
            self._event = None
            if self._release is not None:
                self._release(event)
        return _finished(value)


class TorchCUDA:
    """The few CUDA calls the device makes (a fake stands in for it in CPU tests)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        # Events awaited already, to record again: a step creates no CUDA event. (Recorded on
        # the loop or the launcher thread, given back on the loop: deque's ends are atomic.)
        self._free_events: deque[Any] = deque()

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream()

    def on_stream(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream)

    def set_stream(self, stream: Any) -> None:
        self.torch.cuda.set_stream(stream)

    def record_event(self, stream: Any) -> Any:
        try:
            event = self._free_events.pop()
        except IndexError:  # as many as steps in flight, made once
            event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def release_event(self, event: Any) -> None:
        """``event`` has completed and was awaited: it may be recorded again."""
        self._free_events.append(event)


class CUDADevice(Device):
    """CUDA: steps are enqueued on one dedicated stream; the loop awaits an event recorded
    after each step's kernels and the copy of its sampled ids into pinned host memory.

    Where a step is enqueued from:

    * the event loop (the default): ``launch_step`` runs ``runner.execute(inputs)`` right
      there: a decode step is a CUDA graph replay (a handful of launches), an eager step a few
      hundred kernel launches. No thread hop.
    * the launcher thread (this class's worker, bound to the same stream): steps that must
      wait on the host while they enqueue (a grammar bitmask the loop fills later, prompt
      logprobs), generic ``launch(fn)`` work (embeddings), and, with
      ``ASYNCENGINE_CUDA_EAGER_LAUNCH=thread``, every step that is not a graph replay.
      Trade-off: launching from the thread frees the loop only while the thread waits in the
      driver; Python-level launch overhead still holds the GIL, so the loop's emission and the
      launches contend for it, and each step pays a hop to the thread. Not measured yet.

    Order on the stream is launch order: while anything queued on the launcher thread is not
    enqueued yet, later steps queue behind it on the thread too.
    """

    type = "cuda"
    computes_on_host = False
    kv_reallocatable = False  # CUDA graphs captured the cache's addresses

    def __init__(self, awaiter: str | None = None, eager_launch: str | None = None,
                 cuda: Any = None) -> None:
        super().__init__()
        self.cuda = cuda or TorchCUDA()
        # awaited events back to the pool, where the CUDA calls keep one (TorchCUDA's)
        self._release_event = getattr(self.cuda, "release_event", None)
        self.stream = self.cuda.new_stream()
        self.awaiter = make_event_awaiter(awaiter)
        where = eager_launch or environment.get(EAGER_LAUNCH_ENV)
        if where not in ("loop", "thread"):
            raise ValueError(f"{EAGER_LAUNCH_ENV}={where!r}: must be loop or thread")
        self.eager_on_thread = where == "thread"
        self._pending_on_thread = 0  # launches queued on the thread, not enqueued yet
        self.num_loop_launches = 0
        self.num_thread_launches = 0

    def run_at_start_up(self, fn: Callable[[], T]) -> T:
        """``fn()`` here: CUDA's start-up work runs no OpenMP team."""
        return fn()

    def memory_at_start(self, config: Any) -> Any:
        from asyncengine.executor.kv.sizing import auto_kv_size, check_free_memory, cuda_snapshot

        at_start = cuda_snapshot()
        if auto_kv_size(config):
            check_free_memory(at_start, config.cache.gpu_memory_utilization)
        return at_start

    def prepare_tensor_parallel(self, config: Any) -> None:
        # the NCCL path: written, not run in this repository
        from asyncengine.executor.kv.sizing import auto_kv_size

        if auto_kv_size(config):
            raise ValueError("--tensor-parallel-size > 1 on CUDA: give --kv-cache-memory "
                             "(the memory profile runs rank 0's shard alone)")
        self.eager_on_thread = True  # collectives block: never on the event loop

    def prepare_model(self, model: Any, attn_backend: Any, config: Any, dtype: Any,
                      max_model_len: int) -> Any:
        """FlashInfer's attention JIT now (never on the loop at the first step), then its
        fused norm, RoPE and SiLU (bfloat16, float16)."""
        from asyncengine.executor.attention.prewarm import prewarm_attention
        from asyncengine.executor.kernels import cuda_layer_ops

        attn_backend = prewarm_attention(config, attn_backend, model)
        cuda_layer_ops.setup(model, dtype, self.torch_device, max_model_len)
        return attn_backend

    def sampling_method(self, vocab_size: int) -> str | None:
        """FlashInfer's sampling kernels when installed and compiled (prewarmed now, not at
        the first sampled step); else torch's, with one warning naming why."""
        from asyncengine.executor.attention.prewarm import one_line
        from asyncengine.executor.sampler import flashinfer_sampling

        reason = flashinfer_sampling.flashinfer_import_error()
        if reason is None:
            try:
                flashinfer_sampling.prewarm(self.torch_device, vocab_size)
            except Exception as e:  # the JIT's failure: a compiler error, a missing source
                reason = f"its kernels failed to compile or run ({one_line(e)})"
        if reason is not None:
            logger.warning("sampling backend torch, not flashinfer: %s", reason)
            return None
        return "flashinfer"

    def make_staging(self) -> Any:
        from asyncengine.executor.runtime.staging import PinnedStaging

        return PinnedStaging(self.torch_device, self.stream)

    def launch(self, fn: Callable[[], Any]) -> StepHandle:
        """Generic device work (may block on the host, e.g. read results back): it runs on
        the launcher thread, in order with the steps."""
        return self._via_thread(fn)

    def launch_step(self, runner: Any, inputs: Any) -> StepHandle:
        fn = partial(runner.execute, inputs)
        if (self._pending_on_thread or inputs.blocks_host
                or (self.eager_on_thread and inputs.graph_batch is None)):
            return self._via_thread(fn)
        handle = CUDAStepHandle(asyncio.get_running_loop(), self.awaiter,
                                release=self._release_event)
        self.num_loop_launches += 1
        try:
            result = self._enqueue(fn)
        except BaseException as e:  # delivered to the awaiting step loop
            handle._finish(None, e)
        else:
            handle._finish(result)
        return handle

    def _via_thread(self, fn: Callable[[], Any]) -> StepHandle:
        handle = CUDAStepHandle(asyncio.get_running_loop(), self.awaiter,
                                on_launched=self._launched_on_thread,
                                release=self._release_event)
        self._pending_on_thread += 1
        self.num_thread_launches += 1
        self._ensure_worker()
        self._queue.put((partial(self._enqueue, fn), handle))
        return handle

    def _enqueue(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        with self.cuda.on_stream(self.stream):
            result = fn()
        return result, self.cuda.record_event(self.stream)

    def _launched_on_thread(self) -> None:
        self._pending_on_thread -= 1

    def _on_worker_start(self) -> None:
        self.cuda.set_stream(self.stream)

    async def aclose(self) -> None:
        await super().aclose()
        self.awaiter.close()

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()
