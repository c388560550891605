"""FCFSScheduler: continuous batching with chunked prefill, prefix caching and preemption.

One step (``schedule``) under a token budget (``max_num_batched_tokens``):

1. Running requests, in admission order, get their next tokens: one for a decode, the next
   chunk of a prefill in progress. When blocks run out, the most recently admitted running
   request is preempted by recompute (blocks freed, back to the front of the waiting queue)
   until the allocation fits; when that victim is the request itself, it waits.
2. If nothing was preempted, waiting requests are admitted in queue order while the budget,
   ``max_num_seqs`` and the free blocks allow; a prefix-cache hit skips its tokens, and so do
   the blocks a KV connector holds after it (loaded by the engine before the forward pass).
   Admission stops at the first request that does not fit (no overtaking).

With chunked prefill a prompt takes whatever budget is left and continues next step; without
it a prompt is admitted only whole (a preempted request that outgrew the budget is still
recomputed in chunks, or it could never run again).

:class:`~asyncengine.core.sched.priority.PriorityScheduler` changes only the policy hooks at
the top of the class: the waiting queue, the running order and the choice of victims.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncengine.core.encoder_budget import EncoderBudget
from asyncengine.core.kv.hashing import update_block_hashes
from asyncengine.core.kv.manager import KVCacheManager
from asyncengine.core.multimodal import chunk_without_split
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.sched.interface import (
    KVConnectorLookup,
    KVLoad,
    ModelRunnerOutput,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from asyncengine.core.sched.lora_slots import LoRASlots
from asyncengine.core.sched.queues import FCFSQueue
from asyncengine.core.sched.request_state import apply_step_results, needs_every_position

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig
    from asyncengine.core.kv.block_pool import Block


_NO_DRAFTS: list[int] = []  # shared, never mutated


@dataclass
class _Step:
    """The step being built by ``schedule``."""

    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)


class FCFSScheduler(Scheduler):
    """First come, first served. See the module docstring for one step's rules."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.enable_chunked_prefill = config.scheduler.enable_chunked_prefill
        self.block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.waiting = self._new_waiting_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished ones
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        self.kv_connector: KVConnectorLookup | None = None
        lora = getattr(config, "lora", None)
        self.lora_slots = LoRASlots(lora.max_loras if lora is not None and lora.enable_lora
                                    else None)
        self.encoder_budget: EncoderBudget | None = None

    def set_kv_connector(self, connector: KVConnectorLookup) -> None:
        self.kv_connector = connector

    def set_encoder_budget(self, budget: EncoderBudget) -> None:
        """The image encoder's share of each step (``core/encoder_budget.py``): chunks are
        cut to it as they are to the token budget, and the tokens a cut frees go on."""
        self.encoder_budget = budget

    # -- policy hooks ----------------------------------------------------------------------
    def _new_waiting_queue(self) -> FCFSQueue:
        return FCFSQueue()

    def _running_order(self) -> list[Request]:
        """The order in which running requests get the step's budget."""
        return list(self.running)

    def _choose_victim(self, request: Request) -> Request:
        """Whom to preempt when ``request`` (running) needs blocks; may be ``request``."""
        return self.running[-1]

    def _admission_victim(self, request: Request) -> Request | None:
        """Whom to preempt to admit ``request`` when it does not fit; None: it waits."""
        return None

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        kv = self.kv_cache_manager
        capacity = kv.num_total_blocks * self.block_size
        needed = request.num_prompt_tokens + request.max_tokens
        if kv.sliding_window is not None:  # blocks before the window are released
            needed = min(needed, kv.sliding_window + self.max_num_batched_tokens
                         + 2 * self.block_size)
        if needed > capacity:
            raise ValueError(
                f"request {rid!r} needs up to {needed} tokens of KV cache (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_tokens}) but the cache "
                f"holds {capacity} ({kv.num_total_blocks} blocks of {self.block_size}); a request "
                f"fits when prompt + max_tokens <= {capacity}: lower max_tokens or enlarge the "
                f"KV cache (--kv-cache-memory)")
        if not self.enable_chunked_prefill and request.num_prompt_tokens > \
                self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r} has {request.num_prompt_tokens} prompt tokens, more than "
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) allows in one step "
                f"without chunked prefill; enable --enable-chunked-prefill or raise the budget")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} is {request.status.name}, not waiting")
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self._finish(request, status)
            else:
                self.waiting.remove(request)
                self._finish(request, status, running=False)

    def _finish(self, request: Request, status: RequestStatus, running: bool = True) -> None:
        request.status = status
        if running:
            self.running.remove(request)
            if request.lora is not None:
                self.lora_slots.leave(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.max_num_batched_tokens)
        kv = self.kv_cache_manager
        block_ids, bs = kv.get_block_ids, self.block_size
        scheduled = step.scheduled
        running = RequestStatus.RUNNING
        encoder = self.encoder_budget
        for request in self._running_order():
            budget = step.budget
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this step
            # (finishes_in_flight and _add_to_step, inlined: this loop runs per request.)
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids)
            if placeholders and (
                    request.spec_wait
                    or len(request.output_token_ids) + placeholders >= request.max_tokens
                    or num_tokens + placeholders >= request.max_model_len):
                continue  # its in-flight token is its last, or its drafts wait for it
            start = request.num_computed_tokens
            num_new = num_tokens + placeholders - start
            drafts = request.spec_token_ids
            if drafts and num_new == 1 and not placeholders:
                drafts = drafts[:budget - 1]
                num_new += len(drafts)
            else:
                drafts = _NO_DRAFTS
            if num_new > budget:
                num_new = budget
                if request.mm_inputs:  # an image computed whole (Gemma 3) is not split
                    num_new = chunk_without_split(request.mm_inputs, start, num_new)
            if encoder is not None and request.mm_inputs and num_new > 0:
                num_new = encoder.fit(request, start, num_new)
            if num_new <= 0:
                continue
            rid = request.request_id
            table = block_ids(rid)  # the live list: an allocation extends it
            if len(table) * bs < start + num_new:
                if not self._allocate_running(request, num_new, step):
                    continue
                table = block_ids(rid)
            samples = start + num_new >= num_tokens + placeholders
            scheduled[rid] = ScheduledRequest(request, start, num_new, table, None,
                                              samples, drafts)
            request.num_computed_tokens = start + num_new
            if drafts:  # (then samples is true: the drafts follow the request's last token)
                request.num_output_placeholders = placeholders + 1 + len(drafts)
                request.spec_token_ids = []
            elif samples:
                request.num_output_placeholders = placeholders + 1
            step.budget = budget - num_new
        if not step.preempted:
            self._admit_waiting(step)

        out = SchedulerOutput(scheduled=list(scheduled.values()),
                              finished_req_ids=self._finished_ids,
                              preempted_req_ids=step.preempted)
        self._finished_ids = set()
        return out

    def _allocate_running(self, request: Request, num_new: int, step: _Step) -> bool:
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self._choose_victim(request)
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, step: _Step) -> None:
        passed: list[Request] = []  # waiting for an adapter slot: they keep their place
        while self.waiting and step.budget > 0:
            request = self.waiting.peek()
            if request.request_id in step.preempted:
                break  # it just gave its blocks up
            if request.lora is not None and not self.lora_slots.fits(request):
                passed.append(self.waiting.pop())
                continue
            if not self._admit(request, step):
                break
        for request in reversed(passed):
            self.waiting.add_front(request)

    def _admit(self, request: Request, step: _Step) -> bool:
        """Admit the head of the waiting queue if it fits (possibly after preempting)."""
        kv = self.kv_cache_manager
        blocks, num_cached = self._lookup_prefix(request)
        num_external = self._lookup_external(request, num_cached)
        num_new = request.num_tokens - num_cached - num_external
        if num_new > step.budget:
            if not self.enable_chunked_prefill and request.num_tokens <= \
                    self.max_num_batched_tokens:
                return False
            num_new = step.budget
            if request.mm_inputs:  # an image computed whole (Gemma 3) is not split
                num_new = chunk_without_split(request.mm_inputs, num_cached + num_external,
                                              num_new)
                if num_new <= 0:
                    return False
        if self.encoder_budget is not None and request.mm_inputs:
            num_new = self.encoder_budget.fit(request, num_cached + num_external, num_new)
            if num_new <= 0:
                return False
        while len(self.running) >= self.max_num_seqs or not kv.allocate_slots(
                request, num_external + num_new, blocks):
            victim = self._admission_victim(request)
            if victim is None:
                return False
            self._preempt(victim, step)
        # Victims are less urgent than the head, so it is still the head.
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        num_computed = num_cached + num_external
        request.num_computed_tokens = request.num_cached_tokens = num_computed
        self.running.append(request)
        if request.lora is not None:
            self.lora_slots.enter(request)
        self._add_to_step(request, num_new, step)
        if num_external:
            first, end = num_cached // self.block_size, num_computed // self.block_size
            step.scheduled[request.request_id].kv_load = KVLoad(
                kv.get_block_ids(request.request_id)[first:end],
                request.block_hashes[first:end], num_cached)
        return True

    def _lookup_prefix(self, request: Request) -> tuple[list[Block], int]:
        if needs_every_position(request):
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _lookup_external(self, request: Request, num_cached: int) -> int:
        """Tokens after the local hit of ``num_cached`` that the KV connector will load:
        whole blocks, never the last token (its logits are needed)."""
        if self.kv_connector is None or needs_every_position(request):
            return 0
        bs = self.block_size
        update_block_hashes(request, bs)  # filled even when prefix caching is off
        limit = (request.num_tokens - 1) // bs * bs - num_cached
        found = self.kv_connector.lookup(request, num_cached) // bs * bs
        return max(0, min(found, limit))

    def _add_to_step(self, request: Request, num_new: int, step: _Step) -> None:
        rid = request.request_id
        scheduled = step.scheduled[rid] = ScheduledRequest(
            request, request.num_computed_tokens, num_new,
            self.kv_cache_manager.get_block_ids(rid))
        request.num_computed_tokens += num_new
        if scheduled.samples:
            request.num_output_placeholders += 1
        step.budget -= num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    def _preempt(self, victim: Request, step: _Step) -> None:
        scheduled = step.scheduled.pop(victim.request_id, None)
        if scheduled is not None:
            step.budget += scheduled.num_new_tokens
        self.running.remove(victim)
        if victim.lora is not None:
            self.lora_slots.leave(victim)
        self.kv_cache_manager.free(victim)
        victim.reset_for_recompute()
        self.waiting.add_front(victim)
        step.preempted.add(victim.request_id)
        self.num_preemptions += 1

    # -- results ---------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        return apply_step_results(scheduler_output, runner_output, self.kv_cache_manager,
                                  self._finish)

    # -- misc ------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks)

    def shutdown(self) -> None:
        self.finish_requests(list(self.requests), RequestStatus.FINISHED_ABORTED)
