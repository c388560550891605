"""Request: all the state of one sequence, from arrival to finish (nano-vllm's Sequence).

The scheduler, the KV-cache manager and the runner read and update this one object; nothing
else keeps per-request state. It holds no tensors.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncengine.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    # A fault of this request alone (its grammar raised, its logits had no valid token);
    # ``Request.error`` says what. The others in the batch go on.
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # (a set lookup: comparing enum members is slow)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(s for s in RequestStatus if s >= RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Logprob:
    """One token's log-probability and, optionally, its rank in the distribution."""

    logprob: float
    rank: int | None = None


# For each position: {token_id: Logprob}; the sampled (or prompt) token is always included.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with (``executor/lora/``)."""

    name: str
    # The adapter's identity (a digest of its files): the parent of the request's first
    # block hash, so that the prefix cache never mixes adapters.
    key: bytes
    path: str  # where its weights are read again if they left the CPU cache


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Index among the n samples of a parent request (n > 1), 0 otherwise.
    index: int = 0
    # Who the request is accounted to, for schedulers that share capacity between tenants
    # (the HTTP server sets it from X-Tenant or the API key); None: the default tenant.
    tenant: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (prompt + output). The next step computes from here.
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight, not yet appended (async scheduling: step N+1 is
    # scheduled before step N's token reaches the host). The next step's input at position
    # ``num_tokens`` is such a token; the runner takes it from the device.
    num_output_placeholders: int = 0
    # Tokens found in the prefix cache when the request was (last) admitted.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Chained hashes of the full blocks of all_token_ids (filled by the KV-cache manager).
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Why the request ended with FINISHED_ERROR.
    error: str | None = None

    # Sampled tokens' logprobs (one entry per output token), and the prompt's (entry 0 is None).
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    # Speculative decoding (see core/sched/interface.py). Draft tokens proposed for the next
    # step, set by the engine between steps; the scheduler schedules them after the request's
    # last token and clears the list.
    spec_token_ids: list[int] = field(default_factory=list)
    # Speculation is on for this request: it is not scheduled while a step of it is in flight
    # (its drafts are proposed from settled tokens).
    spec_wait: bool = False
    # The proposer's per-request state (the n-gram index), kept across steps.
    spec_state: Any = None

    # Structured output: an object with the Grammar interface (asyncengine.plugins.Grammar).
    grammar: Any = None
    # The LoRA adapter it runs with (None: the base model).
    lora: LoRARequest | None = None
    # The prompt's images, in prompt order (``core/multimodal.MMInput``); None: text only.
    mm_inputs: list[Any] | None = None
    # M-RoPE models (Qwen2-VL): the prompt's positions (a ``RopePositions`` of
    # ``executor/models/mrope_positions.py``); None: each token at its sequence index.
    rope_positions: Any = None
    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Output tokens this request may produce (bounded by the model's context).
        limit = self.max_model_len - len(self.prompt_token_ids)
        mt = self.sampling_params.max_tokens
        self.max_tokens: int = limit if mt is None else min(mt, limit)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # -- updates -------------------------------------------------------------------------------
    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after appending a token (stop strings are textual and
        live in the detokenizer). Returns the finished status, or None to keep going."""
        sp = self.sampling_params
        out = self.output_token_ids
        num_out, last = len(out), out[-1]
        if num_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_tokens or len(self.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the KV, keep the tokens."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_placeholders = 0  # an in-flight token is dropped, then recomputed
        self.spec_token_ids = []
        self.num_preemptions += 1
        self.status = RequestStatus.PREEMPTED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
