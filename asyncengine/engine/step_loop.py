"""The step loop: it launches step N+1 before it processes step N (async scheduling).

One task runs this loop; it is the only writer of the scheduler, the runner's batch and the
streams. Per iteration, with step N in flight on the device::

    out[N+1] = scheduler.schedule()          # N's tokens unknown yet: counted as placeholders
    await kv_transfer.load(out[N+1])         # KV-connector blocks (if any), before the forward
    inputs = runner.prepare(out[N+1])        # N's sampled ids feed N+1 on the device
    launch(N+1)                              # queued behind N on the device (worker / stream)
    result[N] = await step[N]                # the loop serves HTTP meanwhile
    scheduler.update_from_output(out[N], result[N])
    fill N+1's grammar bitmask               # grammar states now include N's tokens; the
                                             # device waits for it only before sampling N+1
    kv_transfer.save(out[N]); metrics
    emit(N)                                  # detokenize, stop strings, wake streams

So schedule, prepare, update and emission all overlap the device's forward pass: the device
waits for the host only if that work takes longer than a step. The price: a request that ends
at step N (EOS, stop string, length found by emission, abort) has already been scheduled in
N+1, whose token is computed and dropped, never emitted. A request whose in-flight token is
known to be its last (max_tokens) is not scheduled again. Blocks freed while a step is in
flight are rewritten only by later steps, which the device runs after it.

Structured outputs: the mask for step N+1 needs the grammar states after step N's tokens. It
is filled right after ``update_from_output(N)`` while N+1's forward runs, and the device waits
for it before sampling N+1; constrained rows lose no step. What it costs is that wait, if
updating and filling take longer than N+1's forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc

from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.sched.interface import Scheduler, SchedulerOutput
from asyncengine.engine.multimodal import make_encoder_budget
from asyncengine.engine.spec_steps import fill_spec_bitmask, make_drafting, record_spec
from asyncengine.executor.runner import ModelRunner, StepInputs
from asyncengine.executor.runtime.device import Device, StepHandle

logger = logging.getLogger("asyncengine")

#: The step path's phases, as ``StepLoop.phase_cpu_s`` splits the loop thread's CPU: the
#: scheduler, the runner's ``prepare``, the launch (``runner.execute`` where the device
#: enqueues from the loop), ``update_from_output`` with the bitmask, KV saves and metrics,
#: and emission (detokenization, streams, SSE writes and their flush).
PHASES = ("schedule", "prepare", "enqueue", "update", "emit")

#: The name of the task that runs an engine's step loop (what tools tell it apart by).
STEP_LOOP_TASK = "asyncengine.engine.AsyncEngine._run_step_loop"


@dataclass
class Step:
    """A launched step, until the loop has processed its result."""

    out: SchedulerOutput
    inputs: StepInputs
    handle: StepHandle
    grammars: list[Any] | None = None  # the sampled rows' grammars, for a constrained step


class LoopOwner(Protocol):
    """What the loop needs of its engine (``AsyncEngine`` is one)."""

    scheduler: Scheduler
    runner: ModelRunner
    device: Device
    kv_transfer: Any  # KVTransfer | None
    metrics: Any  # EngineMetrics | None
    structured: Any  # StructuredOutputManager | None: made when a request first needs it

    def emit(self, requests: list[Request]) -> None: ...

    async def wait_for_work(self) -> None: ...


class StepLoop:
    def __init__(self, engine: LoopOwner) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.runner = engine.runner
        self.device = engine.device
        self.in_flight: list[Step] = []
        self.num_steps = 0
        self.num_stream_steps = 0  # sum over steps of the requests in them
        # CPU seconds of this thread in each phase of the step path, never the awaits between.
        self.phase_cpu_s = dict.fromkeys(PHASES, 0.0)
        # Speculative decoding: proposes drafts between steps (None: off).
        self.drafting = make_drafting(engine)
        # Images: the encoder's share of each step (``core/encoder_budget.py``; None: no
        # image encoder). It cuts what the scheduler chose, so any scheduler keeps to it.
        self.encoder_budget = make_encoder_budget(engine)
        hand_over = getattr(self.scheduler, "set_encoder_budget", None)
        if self.encoder_budget is not None and hand_over is not None:
            hand_over(self.encoder_budget)  # (fcfs: the tokens a cut frees go on)

    def queued(self, samples: list[Any]) -> None:
        """A request's samples were queued (``AsyncEngine._submit``)."""
        if self.encoder_budget is not None:
            for sample in samples:
                self.encoder_budget.add(sample.request)

    @property
    def step_cpu_s(self) -> float:
        """CPU seconds of this thread in the step path proper: schedule, prepare and launch,
        then update and emission (pushed SSE writes included), never the awaits between."""
        return sum(self.phase_cpu_s.values())

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        prev: Step | None = None
        try:
            while True:
                nxt = await self._launch_next(tg)
                if prev is None:
                    if nxt is None:
                        await self._idle()
                        continue
                    if nxt.grammars is not None:  # no older step: its grammars are current
                        self._fill_bitmask(nxt)
                else:
                    await self._process(prev, nxt, tg)
                prev = nxt
        finally:
            for step in self.in_flight:  # a device thread waiting for a mask must not hang
                if step.inputs.bitmask is not None:
                    step.inputs.bitmask.abandon()
            self.in_flight.clear()

    async def _idle(self) -> None:
        engine = self.engine
        if not self.scheduler.has_unfinished_requests():
            await engine.wait_for_work()
        else:  # requests wait, but none can run now (every block in use)
            await anyio.sleep(0.001)

    async def _launch_next(self, tg: anyio.abc.TaskGroup) -> Step | None:
        if not self.scheduler.has_unfinished_requests():
            return None
        phases = self.phase_cpu_s
        cpu = time.thread_time()
        out = self.scheduler.schedule()
        plan = None
        if self.encoder_budget is not None:
            plan = self.encoder_budget.apply(out)
        if out.is_empty:
            self.runner.release(out)  # its leavers' rows, though nothing runs
            phases["schedule"] += time.thread_time() - cpu
            return None
        now = time.thread_time()
        phases["schedule"] += now - cpu
        cpu = now
        engine = self.engine
        if engine.kv_transfer is not None:  # before prepare(): a failed load widens the step
            await engine.kv_transfer.load(out)
            cpu = time.thread_time()
        grammars = None
        if engine.structured is not None:
            grammars = []
            for s in out.scheduled:
                if s.samples:  # a request's drafts are rows of their own
                    grammars += [s.request.grammar] * (1 + len(s.spec_token_ids))
            if all(g is None for g in grammars):
                grammars = None
        inputs = self.runner.prepare(out, with_bitmask=grammars is not None)
        inputs.mm_plan = plan
        now = time.thread_time()
        phases["prepare"] += now - cpu
        step = Step(out, inputs, self.device.launch_step(self.runner, inputs), grammars)
        self.in_flight.append(step)
        self.num_steps += 1
        self.num_stream_steps += len(out.scheduled)
        phases["enqueue"] += time.thread_time() - now
        return step

    async def _process(self, step: Step, nxt: Step | None, tg: anyio.abc.TaskGroup) -> None:
        engine = self.engine
        try:
            result = await step.handle.wait()
        finally:
            self.in_flight.remove(step)
        phases = self.phase_cpu_s
        cpu = time.thread_time()
        updated = self.scheduler.update_from_output(step.out, result)
        if self.drafting is not None:
            wanting = self.drafting.after_update(
                updated, self.scheduler.get_num_unfinished_requests())
            if wanting:  # a draft model: its steps queue on the device behind this one
                phases["update"] += time.thread_time() - cpu
                await self.drafting.proposer.propose_batch(wanting)
                cpu = time.thread_time()
        if nxt is not None and nxt.grammars is not None:
            self._fill_bitmask(nxt)
        if engine.kv_transfer is not None:  # copies the blocks before the next schedule()
            engine.kv_transfer.save(tg, step.out)
        metrics = engine.metrics
        if metrics is not None:
            prompt_tokens = step.inputs.num_prompt_tokens
            generated = len(result.sampled_token_ids)
            if step.inputs.spec:
                generated += record_spec(metrics, step.inputs.spec, result)
            metrics.on_step(self.scheduler.make_stats(), prompt_tokens, generated)
        now = time.thread_time()
        phases["update"] += now - cpu
        engine.emit(updated)
        phases["emit"] += time.thread_time() - now

    # -- grammar bitmasks ------------------------------------------------------------------
    def _fill_bitmask(self, step: Step) -> None:
        """Fill the step's mask from the grammars' current states. A grammar that raises ends
        its own request; its row allows every token (its token is dropped anyway)."""
        manager = self.engine.structured
        slot = step.inputs.bitmask
        if step.inputs.spec:
            bitmask = fill_spec_bitmask(self, step)
        else:
            try:
                bitmask = manager.fill_bitmask(step.grammars)
            except Exception:
                bitmask = self._fill_row_by_row(step)
        slot.set(bitmask, manager.apply_bitmask)

    def fail_grammar(self, request: Request, e: Exception) -> None:
        """A grammar raised while filling a mask: its request alone ends."""
        logger.warning("request %s: its grammar failed to fill the mask: %s",
                       request.request_id, e)
        request.error = f"its structured-output grammar failed: {type(e).__name__}: {e}"
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self.engine.emit([request])

    def _fill_row_by_row(self, step: Step) -> Any:
        manager = self.engine.structured
        bitmask = manager.backend.allocate_bitmask(len(step.grammars))
        rows = [s for s in step.out.scheduled if s.samples]
        for row, (grammar, s) in enumerate(zip(step.grammars, rows, strict=True)):
            if grammar is None:
                continue
            try:
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row)
            except Exception as e:
                self.fail_grammar(s.request, e)
        return bitmask
