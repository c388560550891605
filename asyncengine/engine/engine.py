"""AsyncEngine: the engine's state, its requests and their streams, and the step loop's task.

Everything runs on one event loop. Callers (HTTP handlers, the offline ``LLM``) add requests
and iterate their streams; one task, the step loop (``step_loop.py``), drives the scheduler
and the device, launching step N+1 before it processes step N. Emission (``output_processor``)
turns each step's tokens into the streams' deltas while the next step runs.

With a KV connector (``--kv-connector``), a step first awaits the loads of the blocks its
admissions found in the connector, and after it the new full blocks are copied and saved in
the background (``asyncengine.engine.kv_transfer``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import anyio.abc

from asyncengine.config import EngineConfig
from asyncengine.core.limits import INT64_MAX, INT64_MIN, SamplingLimits, show
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.core.sched.interface import SchedulerStats
from asyncengine.engine.aborts import Aborts
from asyncengine.engine.cycles import task
from asyncengine.engine.embedding import embed
from asyncengine.engine.errors import (
    EngineDeadError,
    EngineOverloaded,
    EngineShuttingDown,
    RequestFailed,
)
from asyncengine.engine.kv_transfer import KVTransfer
from asyncengine.engine.lora_adapters import LoRAAdapters
from asyncengine.engine.multimodal import prompt_inputs
from asyncengine.engine.output_processor import Emitted
from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.prompts import check_length
from asyncengine.engine.scoring import model_kind
from asyncengine.engine.step_loop import STEP_LOOP_TASK, StepLoop
from asyncengine.engine.stream_group import GenerateMany
from asyncengine.engine.streams import RequestStream
from asyncengine.engine.structured_output import StructuredOutputManager
from asyncengine.engine.tracing import make_output_processor
from asyncengine.executor.build import build
from asyncengine.executor.runtime.thread_policy import BatchScheduled

logger = logging.getLogger("asyncengine")

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloaded", "EngineShuttingDown",
           "RequestFailed"]

#: Seconds the engine waits, when it stops, for KV-connector saves still in flight.
KV_SAVE_DRAIN_TIMEOUT = 30.0


class AsyncEngine(LoRAAdapters, GenerateMany):
    def __init__(self, config: EngineConfig | None = None, *, plugin_manager: Any = None,
                 metrics: Any = None) -> None:
        self.config = config or EngineConfig()
        self.parts = parts = build(self.config, plugin_manager)
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.model_name = parts.model_name
        self.vocab_size = parts.vocab_size
        self.runner = parts.runner
        self.device = parts.device
        self.model_kind = model_kind(parts.runner.model)
        self.scheduler = parts.make_scheduler()
        self.kv_transfer = parts.kv_connector and KVTransfer(
            parts.kv_connector, parts.runner, self.config.cache.block_size)
        self.outputs = make_output_processor(self.tokenizer, self.config.observability,
                                             self.model_name)  # traced with the flag
        # Called after each step's emission: a server flushes the stream writes it batched.
        self.emit_listeners: list[Callable[[], None]] = []
        self.metrics = metrics
        self._wake = anyio.Event()
        self._accepting = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._dead: BaseException | None = None
        self.structured = None  # the StructuredOutputManager, made on first use
        self.loop = StepLoop(self)
        self._failed = anyio.Event()
        sc = self.config.scheduler
        self.sampling_limits = SamplingLimits(
            max_n=sc.max_n, max_logprobs=self.config.model.max_logprobs,
            vocab_size=self.vocab_size)
        self.max_queued_requests = sc.queued_request_limit
        self.aborts = Aborts(self)  # requests whose consumer left (aborts.py)
        self._loop_scope: anyio.CancelScope | None = None
        self._sched = BatchScheduled()  # on the CPU: the loop yields its wakeups to compute

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        self._wake = anyio.Event()  # events belong to the loop that runs the engine
        self._failed = anyio.Event()
        self.aborts.reset()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._accepting = True
        if self.device.computes_on_host and self.parts.parallel is None:
            self._sched.__enter__()  # see thread_policy.py
        self._tg.start_soon(task, self._run_step_loop, self._tg, name=STEP_LOOP_TASK)
        self._tg.start_soon(task, self.aborts.reap)
        if self.parts.parallel is not None:
            self._tg.start_soon(task, self._watch_workers)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._accepting = False
        self.aborts.all()
        assert self._tg is not None
        if self.kv_transfer is not None and exc_info[0] is None:
            with anyio.CancelScope(shield=True):
                await self.kv_transfer.wait_for_saves(KV_SAVE_DRAIN_TIMEOUT)
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc_info)
        finally:
            self._tg = None
            try:
                with anyio.CancelScope(shield=True):
                    if self.parts.parallel is not None and self._dead is not None:
                        await self.parts.parallel.abandon(self.device)  # a worker died
                    await self.device.aclose()
            finally:
                self._sched.__exit__(None, None, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit). After the engine's
        last ``async with`` block; it cannot run steps afterwards."""
        if self.parts.parallel is not None:
            self.parts.parallel.shutdown(self.runner)

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let in-flight requests finish within ``timeout``; abort the rest."""
        self._accepting = False
        with anyio.move_on_after(timeout):
            while self.outputs.streams and self._dead is None:
                await anyio.sleep(0.02)
        self.aborts.all()

    # -- requests -------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                          request_id: str | None = None, priority: int = 0,
                          deltas_only: bool = False, tenant: str | None = None,
                          lora_name: str | None = None,
                          trace_headers: Mapping[str, str] | None = None) -> RequestStream:
        """Validate and queue a request; return its output stream. Raises ValueError for
        invalid input (an unknown ``lora_name`` too), EngineShuttingDown when draining,
        EngineDeadError after a failure. ``lora_name``: the LoRA adapter to run with;
        ``trace_headers``: the caller's W3C trace context (traceparent, tracestate)."""
        self._check_open()
        self.check_queue()
        prepared = await self._prepare(prompt, params or SamplingParams(),
                                       request_id or uuid.uuid4().hex, priority, deltas_only,
                                       tenant, lora_name)
        return self._submit(prepared, trace_headers)

    async def add_requests(self, prompts: list[str | list[int]], params: SamplingParams, *,
                           request_id: str, priority: int = 0, deltas_only: bool = False,
                           tenant: str | None = None, lora_name: str | None = None,
                           trace_headers: Mapping[str, str] | None = None) -> list[RequestStream]:
        """The engine requests of one API call (one per prompt, ids ``request_id-i`` when there
        are several), all or none: every prompt is tokenized and checked, and every grammar
        compiled, before the first one is queued, so a call refused for any of its prompts
        starts no work at all."""
        self._check_open()
        self.check_queue()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                        for i in range(len(prompts))]
        prepared = [await self._prepare(p, params if i == 0 else params.clone(), rid, priority,
                                        deltas_only, tenant, lora_name)
                    for i, (p, rid) in enumerate(zip(prompts, ids, strict=True))]
        streams: list[RequestStream] = []
        try:
            for p in prepared:
                streams.append(self._submit(p, trace_headers))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead}")
        if not self._accepting:
            raise EngineShuttingDown("the engine is not accepting requests")

    async def _prepare(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int, deltas_only: bool, tenant: str | None = None,
                       lora_name: str | None = None) -> RequestStream:
        """A request checked and ready to queue, as its (not yet registered) stream: nothing
        of the engine's state changes here."""
        if not self.model_kind.generates:
            raise ValueError(self.model_kind.refusal("generation"))
        params.validate(self.sampling_limits)
        if not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}], got "
                             f"{show(priority)}")
        lora = self.lora_request(lora_name)
        if request_id in self.outputs.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, mm, rope = await prompt_inputs(self, prompt)  # (images: ImagePrompt)
        check_length(token_ids, params, self.max_model_len)
        grammars = [None] * params.n
        if params.structured_outputs is not None:
            manager = await self._structured_manager()
            grammars = [await manager.compile(params.structured_outputs) for _ in grammars]
        if params.reasoning_end_token_ids and (grammars[0] is not None
                                               or params.thinking_token_budget is not None):
            # The constraint starts after the reasoning; the budget forces its end tag.
            from asyncengine.engine.reasoning_gate import ReasoningGate

            await self._structured_manager()  # the step loop masks through it
            grammars = [ReasoningGate(g, params.reasoning_end_token_ids,
                                      params.thinking_token_budget) for g in grammars]
        samples = []
        for i in range(params.n):
            sp = params
            if params.n > 1:
                sp = params.clone()
                sp.n = 1
                if params.seed is not None:
                    sp.seed = params.seed + i
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}:{i}",
                prompt_token_ids=token_ids, sampling_params=sp,
                eos_token_ids=self.tokenizer.eos_token_ids, max_model_len=self.max_model_len,
                priority=priority, index=i, tenant=tenant, mm_inputs=mm, rope_positions=rope)
            req.grammar = grammars[i]
            req.lora = lora
            if sp.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            samples.append(self.outputs.make_sample(req, sp))
        return RequestStream(request_id, text, token_ids, samples, self.aborts.now,
                             deltas_only=deltas_only)

    def _submit(self, stream: RequestStream,
                trace_headers: Mapping[str, str] | None = None) -> RequestStream:
        """Queue a prepared request's samples and register its stream."""
        if not self._accepting:  # drain began while the grammar compiled
            raise EngineShuttingDown("the engine is not accepting requests")
        if stream.request_id in self.outputs.streams:
            raise ValueError(f"request id {stream.request_id!r} is already in use")
        added: list[str] = []
        try:
            for s in stream.samples:
                self.scheduler.add_request(s.request)  # may refuse: ValueError
                added.append(s.request.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        if trace_headers is not None:
            stream.trace_headers = trace_headers
        self.loop.queued(stream.samples)
        self.outputs.add(stream)
        self._wake.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       tenant: str | None = None, lora_name: str | None = None,
                       trace_headers: Mapping[str, str] | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, each as ``params.output_kind`` says (cumulative, the
        deltas, or only the final one). Leaving the loop early aborts the request."""
        kind = params.output_kind if params is not None else RequestOutputKind.CUMULATIVE
        stream = await self.add_request(prompt, params, request_id=request_id, priority=priority,
                                        tenant=tenant, lora_name=lora_name,
                                        deltas_only=kind == RequestOutputKind.DELTA,
                                        trace_headers=trace_headers)
        try:
            if kind == RequestOutputKind.FINAL_ONLY:
                yield await stream.final()
                return
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def embed(self, prompts: list[list[int]], **kwargs: Any) -> Any:
        """Pooled, normalized hidden states of token-id prompts (``engine/embedding.py``)."""
        return await embed(self, prompts, **kwargs)

    async def abort(self, request_id: str) -> None:
        self.aborts.now(request_id)

    def check_queue(self) -> None:
        """Admission control: EngineOverloaded while ``--max-queued-requests`` requests wait
        (the server also asks before it reads a generation request's body)."""
        waiting = self.scheduler.make_stats().num_waiting
        if waiting >= self.max_queued_requests:
            raise EngineOverloaded(
                f"{waiting} requests are waiting to be scheduled (--max-queued-requests "
                f"{self.max_queued_requests}); retry later")

    @property
    def metrics(self) -> Any:
        """The ``EngineMetrics`` observed each step and at emission (None: not observed)."""
        return self.outputs.metrics

    @metrics.setter
    def metrics(self, value: Any) -> None:
        self.outputs.metrics = value

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    @property
    def num_total_blocks(self) -> int:
        return self.stats().num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free KV-cache blocks (cached-but-unused ones count as free), from the scheduler's
        stats: part of the scheduler contract, so every scheduler reports it."""
        return self.stats().num_free_blocks

    @property
    def running(self) -> bool:
        """Inside ``async with engine``: the step loop's task group is up."""
        return self._tg is not None

    @property
    def error(self) -> BaseException | None:
        """The failure that stopped the step loop, or None while the engine is healthy."""
        return self._dead

    async def wait_failed(self) -> BaseException:
        """Wait until the step loop fails; the failure (``asyncengine serve`` then exits)."""
        await self._failed.wait()
        assert self._dead is not None
        return self._dead

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- the step loop --------------------------------------------------------------------------
    async def _run_step_loop(self, tg: anyio.abc.TaskGroup) -> None:
        with anyio.CancelScope() as self._loop_scope:
            try:
                await self.loop.run(tg)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:  # a bug or a device failure: fail every request, loudly
                logger.exception("the engine's step loop failed")
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = e
        self._failed.set()
        self._accepting = False
        error = EngineDeadError(f"the engine stopped after an error: {e}")
        error.__cause__ = e
        self.outputs.fail_all(error)
        if self._loop_scope is not None:  # its step may never end (a collective, a dead rank)
            self._loop_scope.cancel()

    async def _watch_workers(self) -> None:
        """Tensor parallelism: a worker process that exits fails the engine at once."""
        died = await self.parts.parallel.wait_for_death()
        if died is not None:
            logger.error("%s: the engine stops", died)
            self._fail(RuntimeError(died))

    async def wait_for_work(self) -> None:
        """Sleep until a request arrives (no spinning when idle)."""
        await self._wake.wait()
        self._wake = anyio.Event()

    # -- outputs --------------------------------------------------------------------------------
    def emit(self, requests: list[Request]) -> None:
        """Deliver the requests' new outputs; finish the ones emission ended."""
        done: Emitted = self.outputs.emit(requests)
        for listener in self.emit_listeners:  # e.g. the HTTP layer flushes the writes it batched
            listener()
        if done.stopped:
            self.scheduler.finish_requests(done.stopped, RequestStatus.FINISHED_STOPPED)
        if done.failed:
            self.scheduler.finish_requests(done.failed, RequestStatus.FINISHED_ABORTED)

    # -- helpers --------------------------------------------------------------------------------
    async def _structured_manager(self):
        if self.structured is None:  # the backend's set-up (a vocabulary pass): off the loop
            p = self.parts
            self.structured = await anyio.to_thread.run_sync(
                StructuredOutputManager.make, p.structured_output_backend_cls, p.tokenizer,
                p.vocab_size)
        return self.structured

