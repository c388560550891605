"""The scheduler contract (vLLM V1's, slimmed) and the data it exchanges with the runner.

Plugins import these from ``asyncengine.plugins`` (this module is internal).

A scheduler decides, once per step, which requests run and how many of their tokens are
computed, and owns the KV-cache blocks they use. It is plain Python: it never imports torch.
Implementations live in ``asyncengine/core/sched/`` (built-ins ``fcfs`` and ``priority``) or in
third-party plugins registered through ``register_schedulers``.

One step, as the engine drives it::

    out = scheduler.schedule()                   # SchedulerOutput: plain data
    result = await runner.execute(out)           # ModelRunnerOutput: sampled ids, logprobs
    updated = scheduler.update_from_output(out, result)

Invariants every scheduler keeps:

* ``schedule()`` advances ``request.num_computed_tokens`` by the tokens it schedules, and
  records the value before that in ``ScheduledRequest.start``.
* Async scheduling: the engine calls ``schedule()`` for step N+1 *before*
  ``update_from_output`` for step N. A step that samples a token counts it in
  ``request.num_output_placeholders`` until its result is applied; the next step may then
  schedule the decode of that not-yet-known token (the runner feeds it from the device).
  ``update_from_output`` turns a placeholder into an appended token; results for a request
  that is no longer running (finished, aborted, preempted meanwhile) are dropped.
* A request that reaches the end of its known and in-flight tokens samples one token this
  step (``ScheduledRequest.samples``); a partial prefill chunk samples none.
* Preemption is by recompute: the preempted request's blocks are freed, it keeps its tokens,
  goes back to the waiting queue and is prefilled again later. No request is ever dropped.
* A finished request (stopped, length, aborted, error) has had all its blocks freed before the
  call that finished it returns. (Steps run in order on one device stream, so a block freed
  while an earlier step is in flight is rewritten only by a later step, after that one ends.)
* Speculative decoding (version 2). Between steps the engine may set
  ``request.spec_token_ids`` (draft tokens) and ``request.spec_wait``. A scheduler that
  supports drafts: never schedules a running request with ``spec_wait`` while it has tokens in
  flight (``num_output_placeholders > 0``); schedules a decode (one token, none in flight) that
  has drafts as ``1 + len(drafts)`` tokens, drafts counted in the token budget and cut to it,
  recorded in ``ScheduledRequest.spec_token_ids``, clearing ``request.spec_token_ids`` and
  counting ``1 + len(drafts)`` placeholders. ``update_from_output`` then takes the step's
  tokens from ``ModelRunnerOutput.spec_token_ids`` (the accepted drafts, then one sampled
  token), applies them one at a time with the stop checks (stopping at the first that
  finishes the request), and sets ``num_computed_tokens`` back to ``start + len(tokens)``:
  the KV slots of rejected drafts are rewritten by the next step. A scheduler that ignores
  drafts (schedules one token) stays correct; it only forgoes the speed-up.
* Faults are per request: an exception from a request's grammar, or a sampled id of -1 (no
  valid token), ends that request with ``FINISHED_ERROR`` and ``request.error`` set.
* Images (optional). ``request.mm_inputs`` (None for text) lists the prompt's images
  (``MMInput``: their placeholder positions). A scheduler may ignore it, except that it
  should not end a prefill chunk inside an image with ``whole`` set (Gemma 3's, attended
  both ways): where it cuts a prompt to its budget it calls
  ``chunk_without_split(request.mm_inputs, start, num_new)`` (0: not this step). The
  engine applies the image encoder's per-step budget after ``schedule()``
  (``core/encoder_budget.py``): it may end a chunk at an image's first placeholder, setting
  ``num_new_tokens``, ``num_computed_tokens``, ``samples`` and the placeholder count back as
  the scheduler would have, or drop a request left with nothing from the step. A scheduler
  with ``set_encoder_budget(budget)`` is handed the budget and may ask it while it builds the
  step (``budget.fit(request, start, num_new)``), so that the tokens a cut frees go on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from asyncengine.core.request import PositionLogprobs, Request, RequestStatus

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig

#: Bumped when the contract below changes incompatibly (see docs/plugins.md).
#: 2: public as ``asyncengine.plugins.Scheduler`` (was ``Scheduler``, imported from
#: this module), and draft tokens (speculative decoding, above); a class written for 1
#: that schedules one token per decode is still correct and still accepted.
SCHEDULER_API_VERSION = 2


class KVConnectorLookup(Protocol):
    """The scheduler's side of a KV connector (the whole contract is
    ``asyncengine.plugins.KVConnector``, which satisfies this)."""

    def lookup(self, request: Request, num_local_tokens: int) -> int: ...

    def request_finished(self, request: Request) -> None: ...


@dataclass
class KVLoad:
    """Blocks a KV connector fills before the step's forward pass: ``block_ids[i]`` gets the
    block of ``block_hashes[i]``. They hold the tokens ``[first_token, first_token +
    len(block_ids) * block_size)`` of the request, which the step does not compute."""

    block_ids: list[int]
    block_hashes: list[bytes]
    first_token: int


class ScheduledRequest(msgspec.Struct):
    """One request in a step: compute tokens ``[start, start + num_new_tokens)`` of the
    request's sequence, with its KV in ``block_ids``.

    ``block_ids`` is the request's whole block table as the KV-cache manager holds it (the
    live list, not a copy: read it when the step is prepared, never mutate it). The runner
    keeps each request's table and copies only the blocks it has not seen yet.

    ``samples`` is decided when the step is scheduled: the step computes the last token of the
    sequence, including tokens still in flight (``Request.num_output_placeholders``), so it
    produces a new token.

    ``kv_load``, set on admission when a KV connector holds blocks after the local prefix-cache
    hit, ends at ``start``. If the engine cannot load all of it, it moves ``start`` back to
    the first block not loaded (and grows ``num_new_tokens`` to match) before the forward.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[int]
    kv_load: KVLoad | None = None
    samples: bool = None  # type: ignore[assignment]
    # Draft tokens this step verifies after the request's last token (speculative decoding):
    # they are the step's last ``len(spec_token_ids)`` input tokens.
    spec_token_ids: list[int] = []

    def __post_init__(self) -> None:
        if self.samples is None:
            r = self.request
            self.samples = (self.start + self.num_new_tokens
                            >= r.num_tokens + r.num_output_placeholders)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that finished or were preempted since the previous step: the runner drops any
    # per-request state it keeps for them (their blocks are already free).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What one step computed, keyed by request id."""

    # -1: the row had no valid token (NaN/inf logits, or a grammar that allows nothing); the
    # scheduler ends that request with FINISHED_ERROR.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # The sampled token's logprob (+ top alternatives) for requests that asked for logprobs.
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # For requests that asked for prompt logprobs: the logprobs of prompt tokens
    # ``start + 1, start + 2, ...`` — those this step's positions predict — in order. The
    # request's ``prompt_logprobs`` list starts with None (the first token has no logprob).
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # Requests scheduled with draft tokens: every token the step produced, in order (the
    # accepted drafts, then the token sampled after them; 1 .. drafts + 1 of them), and their
    # logprobs for requests that asked. ``sampled_token_ids`` holds the last one.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of which found (cumulative)
    num_preemptions: int = 0  # cumulative
    # KV-cache blocks: free ones (cached but unused blocks count: they are evictable) and all.
    # /health and /metrics read these, so every scheduler must report them.
    num_free_blocks: int = 0
    num_total_blocks: int = 0


class Scheduler(ABC):
    """The contract between the engine loop and a scheduler.

    Construction: ``cls(config: EngineConfig, num_blocks: int)``; the scheduler builds its own
    KV-cache manager (``asyncengine.core.kv.manager.KVCacheManager``) over ``num_blocks`` blocks of
    ``config.cache.block_size`` tokens. All methods are called from the engine's event loop,
    never concurrently, and must not block it (no I/O, no device work).
    """

    @abstractmethod
    def __init__(self, config: EngineConfig, num_blocks: int) -> None: ...

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING). Its prompt fits the model's context."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work under the token and sequence budgets; allocate blocks."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a step's results: append sampled tokens and logprobs, check token-level stop
        conditions (``Request.check_stop``), free finished requests' blocks. Returns the
        requests that got a new token or finished, in a stable order."""

    @abstractmethod
    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): set ``status``, free blocks.
        Unknown or already finished ids are ignored."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses. False if some are still in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats:
        """A snapshot for ``/health`` and ``/metrics``: queue lengths, KV-cache usage and free
        blocks, cumulative prefix-cache and preemption counts. Called between steps."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def set_kv_connector(self, connector: KVConnectorLookup) -> None:
        """Use a KV connector (``--kv-connector``) when admitting requests: after the local
        prefix-cache hit, ask ``connector.lookup`` how many more whole blocks it holds (never
        the sequence's last token), allocate them, count them as computed, and record them in
        ``ScheduledRequest.kv_load``; call ``connector.request_finished`` when a request
        finishes. Called once, before the first step, only when a connector is configured.

        The default refuses: a scheduler that supports connectors overrides this (the
        built-in ones do)."""
        raise ValueError(f"--kv-connector: the scheduler {type(self).__name__} does not "
                         "support KV connectors")


def __getattr__(name: str) -> type:
    # The contract's name in plugin API 1; kept for one version.
    if name == "SchedulerInterface":
        import warnings

        warnings.warn("asyncengine.core.sched.interface.SchedulerInterface is deprecated since "
                      "asyncengine plugin API 2 and will be removed in the next: use "
                      "asyncengine.plugins.Scheduler", DeprecationWarning, stacklevel=2)
        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
